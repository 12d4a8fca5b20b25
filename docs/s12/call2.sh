#!/usr/bin/env bash
# Session 12 call 2 (issue 30): FP8 GEMMs writing bf16 (tree of this session) on gem_h200: bf16 step, FP8 step
# as shipped, FP8 without the optimization_barrier on the gradient's / every quantisation (docs/s12/fp8_variant.py),
# each `bench train_step` counting the cuBLASLt FP8 calls of its optimised HLO; then the FP8 step's profile.
set -u
# Ran with docs/s12/bf16_results.patch applied (FP8 GEMMs asking for bf16 results; reverted after).
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
B="bench train_step --config configs/gem_h200.toml --steps 10 --batches 2 --pipeline-steps 4"
( time timeout -k 10 100 python3 -m experiments $B ) > $OUT/r/bench_bf16.log 2>&1
for v in barrier nobarrier_g nobarrier; do
  ( time timeout -k 10 110 python3 docs/s12/fp8_variant.py $v $B --set precision.fp8=true --hlo-out $OUT/r/fp8_$v.hlo.gz ) \
    > $OUT/r/bench_fp8_$v.log 2>&1
done
( time timeout -k 10 110 python3 -m experiments profile --config configs/gem_h200.toml --set precision.fp8=true --steps 3 \
    --warmup 2 --batches 2 --pipeline-batches 8 --out /tmp/pg_fp8 --top 60 ) > $OUT/r/profile_fp8.log 2>&1
mkdir -p $OUT/r/pg_fp8; cp /tmp/pg_fp8/*.csv /tmp/pg_fp8/*.md /tmp/pg_fp8/summary.json $OUT/r/pg_fp8/ 2>/dev/null
tar -C $OUT -czf $OUT/call2.tgz r && rm -rf $OUT/r
