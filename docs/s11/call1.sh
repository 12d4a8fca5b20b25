#!/usr/bin/env bash
# Session 11 call 1 (issue 27): the fused layer-norm kernels. `bench norm` (kernel vs XLA, tiles); then
# gem_h200 and hstu_nvidia `bench train_step` with model.norm_implementation = reference (before) and auto
# (the kernels), in that order, in this one call; then the gem_h200 profile with the kernels.
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
( time timeout -k 10 120 python3 -m experiments bench norm ) > $OUT/r/bench_norm.log 2>&1
for cfg in gem_h200 hstu_nvidia; do
  for impl in reference auto; do
    ( time timeout -k 10 110 python3 -m experiments bench train_step --config configs/$cfg.toml --steps 10 --batches 2 \
        --set model.norm_implementation=\"$impl\" ) > $OUT/r/step_${cfg}_$impl.log 2>&1
  done
done
( time timeout -k 10 150 python3 -m experiments profile --config configs/gem_h200.toml --steps 3 --warmup 2 --batches 2 \
    --pipeline-batches 24 --out /tmp/pg --top 80 ) > $OUT/r/gem_profile.log 2>&1
cp /tmp/pg/*.csv $OUT/r/ 2>/dev/null
tar -C $OUT -czf $OUT/call1.tgz r && rm -rf $OUT/r
