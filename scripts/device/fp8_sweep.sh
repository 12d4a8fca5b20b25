#!/usr/bin/env bash
# The FP8 table `precision.fp8 = "auto"` reads: every FP8 GEMM shape of the GPU configs and a sweep of widths,
# FP8 (with its quantisation passes) vs bf16, forward + backward of one Dense layer. Rows print as measured.
#   bash scripts/device/fp8_sweep.sh        then copy $OUT/fp8_speedups.json to gem_jax/model/
set -u  # on a GPU host with the package installed: pip install -e '.[cuda]'
OUT=${OUT:-runs/fp8_sweep}; mkdir -p "$OUT"  # where the logs go
export PYTHONPATH=$PWD
cp gem_jax/model/fp8_speedups.json "$OUT/fp8_speedups.json" 2>/dev/null || echo '{}' > "$OUT/fp8_speedups.json"
timeout -k 10 "${LIMIT:-400}" python3 -m experiments bench fp8 \
  --config configs/gem_h200.toml,configs/hstu_nvidia.toml,configs/gem_long.toml \
  --widths "${WIDTHS:-512,1024,2048,4096}" --square 0 --recipes delayed --reps "${REPS:-10}" \
  --write-table "$OUT/fp8_speedups.json" 2>&1 | tee "$OUT/fp8_sweep.log"
