#!/usr/bin/env bash
# The relative bias in the Hopper jagged attention kernels, on one GPU: first the default call with the GEM bias
# against the float32 reference (sorted and unsorted timestamps; the timings are skipped if it fails), then the
# forward and backward with and without the bias on the given shapes (scripts/device/bias_attribution.py; with
# VARIANTS=all also each part of the bias skipped; JOBS variants compile at a time, default 6), while ptxas's
# report and SASS of each kernel with and without the bias (registers, stack frame, spills; the SASS
# instructions that test the bias's suspects counted per kernel) are made in the background
# (scripts/device/kernel_sass.py). Logs and tables under $OUT.
#   bash scripts/device/attention_bias.sh                 (u1k and h4k, bias on and off; about 6 minutes)
#   SHAPES="u1k h4k:bwd" VARIANTS=all bash scripts/device/attention_bias.sh   (SHAPE:fwd|bwd: one direction)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-runs/attention_bias}; mkdir -p "$OUT" /tmp/ptxas
SHAPES=${SHAPES:-u1k h4k}
VARIANTS=${VARIANTS:-no bias,bias}
for vk in bias:dkv bias:dq bias:fwd nobias:dkv nobias:dq bias-time_bucket:dq; do
  SASS=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 scripts/device/kernel_sass.py "${vk%%:*}" "${vk##*:}" \
    > "/tmp/ptxas/${vk/:/_}.log" 2>&1 &
done
timeout -k 10 "${CHECK_S:-110}" python3 scripts/device/bias_attribution.py --check > "$OUT/check.log" 2>&1
rc=$?; echo "check rc=$rc"; grep "CHECK\|rror" "$OUT/check.log" | head -5
if [ $rc -eq 0 ]; then
  for s in $SHAPES; do  # SHAPE or SHAPE:fwd / SHAPE:bwd (one direction)
    extra=(); [ "$VARIANTS" != all ] && extra=(--variants "$VARIANTS")
    [ "$s" != "${s%%:*}" ] && extra+=(--only "${s##*:}")
    s=${s%%:*}
    timeout -k 10 "${SHAPE_S:-170}" python3 scripts/device/bias_attribution.py "$s" --jobs "${JOBS:-6}" "${extra[@]}" \
      > "$OUT/$s.log" 2>&1
    echo "$s rc=$?"; grep "^ROW\|rror" "$OUT/$s.log" | head -20
  done
fi
wait
for f in /tmp/ptxas/*.log; do
  echo "$(basename "$f" .log): $(grep -a -E "stack frame|Used [0-9]+ registers|ptxas.*(warn|Perf)" "$f" | sort -u | tr '\n' ' ')"
done | tee "$OUT/ptxas.txt"
python3 scripts/device/kernel_sass.py opcodes /tmp/ptxas/*.log | tee "$OUT/sass_opcodes.md"
