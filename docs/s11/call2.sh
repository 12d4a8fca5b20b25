#!/usr/bin/env bash
# Session 11 call 2 (issue 27): `bench norm` with its check against a float32 truth; the gem_h200 profile before
# (model.norm_implementation = reference) and after (auto: the fused kernels) in this one call; hstu_nvidia
# `bench train_step` before and after (call 1's reference run was cut by its 110 s limit while compiling).
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
( time timeout -k 10 80 python3 -m experiments bench norm ) > $OUT/r/bench_norm.log 2>&1
for impl in reference auto; do
  ( time timeout -k 10 100 python3 -m experiments profile --config configs/gem_h200.toml --steps 3 --warmup 2 --batches 2 \
      --pipeline-batches 24 --out /tmp/pg_$impl --top 80 --set model.norm_implementation=\"$impl\" ) > $OUT/r/gem_profile_$impl.log 2>&1
  mkdir -p $OUT/r/pg_$impl; cp /tmp/pg_$impl/*.csv $OUT/r/pg_$impl/ 2>/dev/null
done
for impl in reference auto; do
  ( time timeout -k 10 170 python3 -m experiments bench train_step --config configs/hstu_nvidia.toml --steps 10 --batches 2 \
      --set model.norm_implementation=\"$impl\" ) > $OUT/r/step_hstu_nvidia_$impl.log 2>&1
done
tar -C $OUT -czf $OUT/call2.tgz r && rm -rf $OUT/r
