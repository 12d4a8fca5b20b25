#!/usr/bin/env bash
# Session 8 call 1: hstu_nvidia profile (issue 27, Mosaic D=256 bwd default), bf16 vs fp8 train_step (issue 30), gem_h200 profile.
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=clocks.sm,memory.used,temperature.gpu --format=csv > $OUT/gpu_start.txt
git log --oneline -1 > $OUT/tree.txt 2>/dev/null
python3 -c "import jax, flax; print(jax.__version__, flax.__version__)" >> $OUT/tree.txt
( time timeout -k 10 230 python3 -m experiments profile --config configs/hstu_nvidia.toml --steps 3 --warmup 2 --batches 2 --pipeline-batches 24 ) > $OUT/hstu_profile.log 2>&1
( time timeout -k 10 150 python3 -m experiments bench train_step --config configs/hstu_nvidia.toml --steps 10 --batches 2 --pipeline-steps 24 ) > $OUT/hstu_bench_bf16.log 2>&1
( time timeout -k 10 150 python3 -m experiments bench train_step --config configs/hstu_nvidia.toml --set precision.fp8=true --steps 10 --batches 2 --pipeline-steps 24 ) > $OUT/hstu_bench_fp8.log 2>&1
echo done > $OUT/done.txt
