#!/usr/bin/env bash
# Session 9 call 2: hstu_nvidia step bf16 vs precision.fp8="auto" with the new table (issue 30); gem_long end to end (issue 27).
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=clocks.sm,memory.used,temperature.gpu --format=csv > $OUT/gpu_start.txt
( time timeout -k 10 150 python3 -m experiments bench train_step --config configs/hstu_nvidia.toml --steps 10 --batches 2 --pipeline-steps 4 ) > $OUT/hstu_bench_bf16.log 2>&1
( time timeout -k 10 150 python3 -m experiments bench train_step --config configs/hstu_nvidia.toml --set precision.fp8=auto --steps 10 --batches 2 --pipeline-steps 4 ) > $OUT/hstu_bench_auto.log 2>&1
( time timeout -k 10 150 python3 -m experiments train --config configs/gem_long.toml --workdir /tmp/gl --set train.steps=100000 --set train.log_every=10 --set train.progress=false --set train.checkpoint_every=0 ) > $OUT/train_gem_long.log 2>&1
cp /tmp/gl/metrics.jsonl $OUT/train_gem_long_metrics.jsonl 2>/dev/null
echo done > $OUT/done.txt
