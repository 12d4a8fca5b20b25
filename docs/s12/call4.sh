#!/usr/bin/env bash
# Session 12 call 4 (issue 30): FP8 GEMMs with bf16 results and XLA's Triton GEMM fusion off
# (--xla_gpu_enable_triton_gemm=false), so the dot reaches the cuBLASLt rewriter with its own result type.
# gem_h200 `bench train_step`: bf16 as shipped; FP8 on the HSTU layers, triton off, bf16 results; the same with
# f32 results cast after (docs/s12/fp8_variant.py f32out); then one FP8 Dense per hstu_nvidia shape (`bench fp8`,
# triton off); last FP8 on every default layer (HSTU + Wukong) with triton off, which failed in call 3.
set -u
# Ran with docs/s12/bf16_results.patch applied (FP8 GEMMs asking for bf16 results; reverted after).
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
B="bench train_step --config configs/gem_h200.toml --steps 10 --batches 2 --pipeline-steps 4"
H='--set precision.fp8=true --set precision.fp8_layers=["hstu/"]'
( time timeout -k 10 90 python3 -m experiments $B ) > $OUT/r/bench_bf16.log 2>&1
export XLA_FLAGS=--xla_gpu_enable_triton_gemm=false
( time timeout -k 10 110 python3 docs/s12/fp8_variant.py barrier $B $H --hlo-out $OUT/r/fp8_hstu_bf16out.hlo.gz ) \
  > $OUT/r/bench_fp8_hstu_bf16out.log 2>&1
( time timeout -k 10 110 python3 docs/s12/fp8_variant.py f32out $B $H --hlo-out $OUT/r/fp8_hstu_f32out.hlo.gz ) \
  > $OUT/r/bench_fp8_hstu_f32out.log 2>&1
( time timeout -k 10 100 python3 -m experiments bench fp8 --config configs/hstu_nvidia.toml --square 0 --recipes delayed \
    --set 'precision.fp8_layers=["hstu/"]' ) > $OUT/r/bench_fp8_layer_hstu_nvidia.log 2>&1
( time timeout -k 10 90 python3 -m experiments $B --set precision.fp8=true ) > $OUT/r/bench_fp8_all.log 2>&1
tar -C $OUT -czf $OUT/call4.tgz r && rm -rf $OUT/r
