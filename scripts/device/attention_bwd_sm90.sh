#!/usr/bin/env bash
# The Hopper (Mosaic GPU) jagged attention backward (pallas_kernels/jagged_attention/gpu_sm90_backward.py) on the
# device: FIRST its gradients against the float32 reference on fresh random inputs (small shapes, both
# activations, window, targets, D=64/128/256, unaligned starts, tail rows; scripts/device/attention_bwd_sm90.py
# check), THEN per timed shape a check against the Triton backward on that shape's fresh inputs and the two
# backwards timed side by side (TFLOP/s by the peer's count); a table at the end. Logs under $OUT.
# Then (MEET, default d256) the D=256 kernel with and without its consumers' meeting (KernelOptions.split_meet), and (SWEEP,
# default n1024) the Mosaic backward's tile knobs on one shape.
#   bash scripts/device/attention_bwd_sm90.sh                 (default cases, < 540 s)
#   CHECK="11 12 13 14" CASES=d256 SWEEP=d256 bash scripts/device/attention_bwd_sm90.sh   (head dim 256 only)
#   CASES="n1024 bias1024" SWEEP= MEET= REPS=20 bash scripts/device/attention_bwd_sm90.sh
# Cases (scripts/device/attention_bwd_sm90.py CASES): n1024 n4096 heavy d64 d256 bias1024 softmax. d256 runs the
# Mosaic backward unless KernelOptions.hopper_backward_d256 is False (the script's options turn it on); softmax is no
# target, so it is not in the default list. Empty CASES runs the default list: CASES=none runs none.
set -u
[ -d .whl ] && python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=$PWD
CASES=${CASES:-d256 n1024 n4096 d64 bias1024}
[ "$CASES" = none ] && CASES=
SWEEP=${SWEEP-n1024}
MEET=${MEET-d256}
REPS=${REPS:-10}
CHECK=${CHECK-11 12 13 14 0 1 2 3 4 5 6 7 8 9 10}  # check case indices, in this order (empty: all); CHECK_LIMIT s
CHECK_LIMIT=${CHECK_LIMIT:-240}
declare -A LIMIT=([n1024]=110 [n4096]=150 [heavy]=150 [d64]=90 [d256]=150 [bias1024]=150 [softmax]=80)
for case in $CASES; do v=LIMIT_$case; [ -n "${!v:-}" ] && LIMIT[$case]=${!v}; done  # e.g. LIMIT_n4096=200
start=$(date +%s)
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > "$OUT/smi.txt" 2>&1
timeout -k 10 "$CHECK_LIMIT" python3 scripts/device/attention_bwd_sm90.py check $CHECK > "$OUT/check.log" 2>&1
echo "check rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
grep -c " -> OK" "$OUT/check.log" | sed 's/^/checks OK: /'; grep " -> FAIL\|Error\|error:" "$OUT/check.log" | head -20
for case in $CASES; do
  limit=${LIMIT[$case]:-60}
  if [ $(( $(date +%s) - start + limit )) -gt ${BUDGET:-530} ]; then echo "$case: skipped (time budget)" | tee -a "$OUT/times.txt"; continue; fi
  t0=$(date +%s)
  timeout -k 10 "$limit" python3 scripts/device/attention_bwd_sm90.py time "$case" "$REPS" > "$OUT/$case.log" 2>&1
  echo "$case rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.txt"
  grep "check vs Triton\|Error\|error:" "$OUT/$case.log" | head -5
done
for case in $MEET; do  # D=256: KernelOptions.split_meet on, then off
  if [ $(( $(date +%s) - start + 90 )) -gt ${BUDGET:-530} ]; then echo "meet $case: skipped (time budget)" | tee -a "$OUT/times.txt"; continue; fi
  t0=$(date +%s)
  timeout -k 10 90 python3 scripts/device/attention_bwd_sm90.py meet "$case" "$REPS" > "$OUT/meet_$case.log" 2>&1
  echo "meet $case rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.txt"
  grep -h "^MEET \|Error\|error:" "$OUT/meet_$case.log" | head -4
done
for case in $SWEEP; do
  if [ $(( $(date +%s) - start + 60 )) -gt ${BUDGET:-530} ]; then echo "sweep $case: skipped (time budget)" | tee -a "$OUT/times.txt"; continue; fi
  t0=$(date +%s)
  timeout -k 10 60 python3 scripts/device/attention_bwd_sm90.py sweep "$case" "$REPS" > "$OUT/sweep_$case.log" 2>&1
  echo "sweep $case rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.txt"
  grep -h "^SWEEP \|FAILED" "$OUT/sweep_$case.log"
done
{
  echo "| case | Triton bwd TFLOP/s | Mosaic bwd TFLOP/s | Mosaic / Triton | |"
  echo "| --- | --- | --- | --- | --- |"
  for case in $CASES; do grep -h "^ROW " "$OUT/$case.log" 2>/dev/null | sed 's/^ROW //'; done
} | tee "$OUT/table.md"
echo "total $(( $(date +%s) - start )) s"
