#!/usr/bin/env bash
# The attention preset table on one GPU: `bench attention --preset NAME` for every row (shapes.ATTENTION_PRESETS), each
# preset one process (its log $OUT/NAME.log): every implementation checked against the float32 reference on
# fresh inputs, then timed side by side (ours on Mosaic GPU and on Triton; on the equal-length rows cuDNN and
# tokamax, dense causal softmax); one table of all rows at the end ($OUT/table.md).
#   bash scripts/device/attention_presets.sh                              (every preset, within BUDGET s)
#   PRESETS="softmax8x4k_h16d128 b4n8k_d256" REPS=10 bash scripts/device/attention_presets.sh
#   ARGS=--quick OUT=/tmp/presets bash scripts/device/attention_presets.sh   (anywhere, CPU too: shrunk presets)
# tokamax (needs jax >= 0.11.1, python >= 3.12) is not on the device: its wheel and the ones it imports travel in
# .whl (git-ignored; carry it), fetched here from the repository root with
#   ../shared/tools/fetch-gpu-wheels.sh tokamax==0.0.17 einshape==1.0 immutabledict==4.3.1 qwix==0.1.8 \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     typing-extensions==4.16.0 tensorboardx==2.6.5 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0
# (in a git worktree, where .git is a file, run its `pip download` line by hand). Without them the tokamax rows
# read "n/a (tokamax: ...)" and $OUT/tokamax.txt says why.
set -u
OUT=${OUT:-runs/attention_presets}; mkdir -p "$OUT"  # where the logs go
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1
  echo "wheels rc=$?" | tee -a "$OUT/times.txt"
fi
export PYTHONPATH=$PWD:/tmp/site
PRESETS=${PRESETS:-u1k u4k h4k dense8x4k_h16d128 b64n4k_d256 b16n16k_d64 softmax8x4k_h16d128 b4n8k_d256}
REPS=${REPS:-20}
ARGS=${ARGS:-}  # more `bench attention` options, e.g. --quick or --no-check
declare -A LIMIT=([u4k]=150 [b16n16k_d64]=150 [softmax8x4k_h16d128]=150)  # others ${LIMIT_DEFAULT:-110} s
start=$(date +%s)
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > "$OUT/smi.txt" 2>&1
timeout -k 5 60 python3 -c "import jax, tokamax; print('jax', jax.__version__, 'tokamax', tokamax.__version__)" \
  > "$OUT/tokamax.txt" 2>&1
echo "tokamax import rc=$?: $(tail -1 "$OUT/tokamax.txt")" | tee -a "$OUT/times.txt"
for preset in $PRESETS; do
  limit=${LIMIT[$preset]:-${LIMIT_DEFAULT:-110}}
  if [ $(( $(date +%s) - start + limit )) -gt "${BUDGET:-540}" ]; then
    echo "$preset: skipped (time budget)" | tee -a "$OUT/times.txt"; continue
  fi
  t0=$(date +%s)
  timeout -k 10 "$limit" python3 -m experiments bench attention --preset "$preset" --reps "$REPS" $ARGS \
    > "$OUT/$preset.log" 2>&1
  echo "$preset rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.txt"
  grep -h "^| .*\(FAIL (\|error (\)" "$OUT/$preset.log" | head -5
done
{
  grep -h -m1 -A1 "^| preset |" "$OUT"/*.log | head -2
  for preset in $PRESETS; do grep -h "^| $preset |" "$OUT/$preset.log" 2>/dev/null; done
} | tee "$OUT/table.md"
echo "total $(( $(date +%s) - start )) s"
