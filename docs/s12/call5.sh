#!/usr/bin/env bash
# Session 12 call 5 (issue 30): the SiLU-backward FP8 kernel checked against its reference on fresh inputs and
# timed (docs/s12/check_silu_fp8.py); if it agrees, gem_h200 `bench train_step` with the uvqk layers' backward
# GEMMs in FP8 (precision.fp8_gemms = "backward": forward bf16, gradient quantised in the kernel), then bf16.
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
( time timeout -k 5 60 python3 docs/s12/check_silu_fp8.py ) > $OUT/r/check.log 2>&1; rc=$?
cat $OUT/r/check.log
if [ $rc -eq 0 ]; then
  B="bench train_step --config configs/gem_h200.toml --steps 10 --batches 2 --pipeline-steps 4"
  L='precision.fp8_layers=["hstu/0/uvqk","hstu/1/uvqk","hstu/2/uvqk","hstu/3/uvqk"]'
  ( time timeout -k 5 95 python3 -m experiments $B --set precision.fp8=true --set precision.fp8_gemms=\"backward\" \
      --set "$L" ) > $OUT/r/bench_fp8_backward_uvqk.log 2>&1
  grep -E "back_to_back|cublas_lt_f8|fp8_pattern|rror" $OUT/r/bench_fp8_backward_uvqk.log
  ( time timeout -k 5 85 python3 -m experiments $B ) > $OUT/r/bench_bf16.log 2>&1
  grep -E "back_to_back|rror" $OUT/r/bench_bf16.log
fi
tar -C $OUT -czf $OUT/call5.tgz r && rm -rf $OUT/r
