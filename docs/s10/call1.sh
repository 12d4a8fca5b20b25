#!/usr/bin/env bash
# Session 10 call 1: gem_long end to end with grain's per-worker buffer 1 (before) and 8 (the new default),
# and the optimised HLO of the gem_h200 step (issue 27).
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
for buf in 1 8; do
  ( time timeout -k 10 80 python3 -m experiments train --config configs/gem_long.toml --workdir /tmp/gl$buf --set train.steps=100000 --set train.log_every=10 --set train.progress=false --set train.checkpoint_every=0 --set data.worker_buffer_size=$buf ) > $OUT/r/train_gem_long_buf$buf.log 2>&1
  cp /tmp/gl$buf/metrics.jsonl $OUT/r/train_gem_long_buf${buf}_metrics.jsonl 2>/dev/null
done
( time timeout -k 10 200 python3 -m experiments bench train_step --config configs/gem_h200.toml --steps 5 --batches 2 --hlo-out $OUT/r/gem_h200.hlo.gz ) > $OUT/r/gem_h200_bench.log 2>&1
tar -C $OUT -czf $OUT/call1.tgz r && rm -rf $OUT/r
