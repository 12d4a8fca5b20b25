#!/usr/bin/env bash
# Session 9 call 1: gem_h200 profile with its op table (issue 27, "other fusions"), then the FP8 speed table (issue 30).
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=clocks.sm,memory.used,temperature.gpu --format=csv > $OUT/gpu_start.txt
python3 -c "import jax, flax; print(jax.__version__, flax.__version__)" > $OUT/versions.txt
( time timeout -k 10 200 python3 -m experiments profile --config configs/gem_h200.toml --steps 3 --warmup 2 --batches 2 --pipeline-batches 24 --out /tmp/pg --top 80 ) > $OUT/gem_profile.log 2>&1
mkdir -p $OUT/gem_prof; cp /tmp/pg/breakdown.md /tmp/pg/breakdown.csv /tmp/pg/ops.csv /tmp/pg/summary.json $OUT/gem_prof/ 2>/dev/null
LIMIT=${LIMIT:-320} bash scripts/device/fp8_sweep.sh > $OUT/fp8_sweep_outer.log 2>&1
echo done > $OUT/done.txt
