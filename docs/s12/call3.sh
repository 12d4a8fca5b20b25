#!/usr/bin/env bash
# Session 12 call 3 (issue 30): does XLA write the FP8 GEMMs' bf16 result directly when its Triton GEMM fusion
# pass is off? gem_h200 `bench train_step`, bf16 and delayed FP8, both with --xla_gpu_enable_triton_gemm=false.
set -u
# Ran with docs/s12/bf16_results.patch applied (FP8 GEMMs asking for bf16 results; reverted after).
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
B="bench train_step --config configs/gem_h200.toml --steps 10 --batches 2 --pipeline-steps 4"
export XLA_FLAGS=--xla_gpu_enable_triton_gemm=false
( time timeout -k 10 100 python3 -m experiments $B --hlo-out $OUT/r/bf16_notriton.hlo.gz ) > $OUT/r/bench_bf16_notriton.log 2>&1
( time timeout -k 10 120 python3 -m experiments $B --set precision.fp8=true --hlo-out $OUT/r/fp8_notriton.hlo.gz ) \
  > $OUT/r/bench_fp8_notriton.log 2>&1
tar -C $OUT -czf $OUT/call3.tgz r && rm -rf $OUT/r
