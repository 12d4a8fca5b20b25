#!/usr/bin/env bash
# Runs only on the prototype's tree, 1c164fd: pallas_kernels/jagged_attention/gpu.BIAS_ROWS left with its revert (c206191).
# Session 10 call 3 (issue 27): call 2's "buckets" backward overflowed shared memory at gem_h200 (245760 of
# 232448 bytes) with the no-bias tiles; here the values baseline and "buckets" with the in-kernel-bias tiles
# or one backward stage, gem_h200 bench train_step in one call; then the gem_h200 profile of the first that ran.
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
B="bench train_step --config configs/gem_h200.toml --steps 10 --batches 2"
for v in "values default" "buckets computed" "buckets stages1"; do
  set -- $v
  ( time timeout -k 10 150 python3 docs/s10/bucket_bench.py $1 $2 $B ) > $OUT/r/bench_$1_$2.log 2>&1
done
best=""
for v in "buckets computed" "buckets stages1"; do
  set -- $v; grep -q '"mfu"' $OUT/r/bench_$1_$2.log && { best="$1 $2"; break; }
done
if [ -n "$best" ]; then
  ( time timeout -k 10 200 python3 docs/s10/bucket_bench.py $best profile --config configs/gem_h200.toml --steps 3 \
      --warmup 2 --batches 2 --pipeline-batches 24 --out /tmp/pg --top 80 ) > $OUT/r/gem_profile.log 2>&1
  cp /tmp/pg/*.csv $OUT/r/ 2>/dev/null
fi
tar -C $OUT -czf $OUT/call3.tgz r && rm -rf $OUT/r
