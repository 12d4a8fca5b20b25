#!/usr/bin/env bash
# Runs only on the prototype's tree, 1c164fd: pallas_kernels/jagged_attention/gpu.BIAS_ROWS left with its revert (c206191).
# Session 10 call 2 (issue 27): the Triton backward's bias from the shared [T, W] int16 time-bucket array
# ("buckets", new) against the per-layer [H, T, W] values array ("values", before), gem_h200 step in one call;
# a fuzz of the kernels against the float32 reference first; then the gem_h200 profile with "buckets".
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
( time timeout -k 10 150 python3 -m experiments fuzz attention --seconds 120 --seed 11 ) > $OUT/r/fuzz.log 2>&1
for mode in values buckets; do
  ( time timeout -k 10 150 python3 -c "
import sys, runpy
import pallas_kernels.jagged_attention.gpu as g
g.BIAS_ROWS = '$mode'
sys.argv = ['experiments', 'bench', 'train_step', '--config', 'configs/gem_h200.toml', '--steps', '10', '--batches', '2']
runpy.run_module('experiments', run_name='__main__')
" ) > $OUT/r/bench_$mode.log 2>&1
done
( time timeout -k 10 200 python3 -m experiments profile --config configs/gem_h200.toml --steps 3 --warmup 2 --batches 2 --pipeline-batches 24 --out /tmp/pg --top 80 ) > $OUT/r/gem_profile.log 2>&1
cp /tmp/pg/*.csv $OUT/r/ 2>/dev/null
tar -C $OUT -czf $OUT/call2.tgz r && rm -rf $OUT/r
