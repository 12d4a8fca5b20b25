#!/usr/bin/env bash
# FP8 quality with statistics (docs/fp8.md, "Quality"): gem_h200 trained 300 steps per recipe and seed at one
# data worker count (the worker count decides the batches, so runs of the same seed see the same batches),
# $PARALLEL (2: ~35 GiB of activations each) runs at a time on the one GPU (quality only: their wall times mean
# nothing); then the table of scripts/device/fp8_quality.py. Logs, metrics and the table in $OUT/fp8_quality.tgz.
#   RECIPES="bf16 delayed margin1 current" SEEDS="0 1 2" bash scripts/device/fp8_quality.sh
#   RECIPES="bf16 bf16res uvqk" bash scripts/device/fp8_quality.sh   (other variants below: same table, vs bf16)
# ("delayed" is the delayed recipe with no headroom, fp8_margin = 0; "margin1" the default, one binade.)
# A run takes ~100 s of wall (2026-12-03, two at a time: four runs in 280 s). The seeds may be split over several
# invocations: unpack every archive into one directory and run the table on it.
set -u  # on a GPU host with the package installed: pip install -e '.[cuda]'
OUT=${OUT:-runs/fp8_quality}; mkdir -p "$OUT"  # where the logs go
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
L=/tmp/fp8_quality; R=$L/runs; mkdir -p $R
W=${W:-6}; STEPS=${STEPS:-300}; PARALLEL=${PARALLEL:-2}; LIMIT=${LIMIT:-540}
# The archive holds logs, metrics and run records only (a checkpoint is ~GBs), also when LIMIT cuts the script
# short (the runs it stopped are in the table as far as they got).
finish() {
  kill $(jobs -rp) 2>/dev/null; wait
  python3 scripts/device/fp8_quality.py $R > $L/table.md 2>&1; cat $L/table.md
  (cd /tmp && find fp8_quality -name '*.log' -o -name metrics.jsonl -o -name run.json -o -name table.md) |
    tar czf $OUT/fp8_quality.tgz -C /tmp -T -
}
trap 'finish; exit 143' TERM INT
declare -A V
V[bf16]=""
V[delayed]="--set precision.fp8=true --set precision.fp8_margin=0"
V[margin1]="--set precision.fp8=true --set precision.fp8_margin=1"
V[current]="--set precision.fp8=true --set precision.fp8_recipe=\"current\""
# Not FP8: bf16 with the HSTU norms in plain jnp (the quality check of the fused layer-norm kernels).
V[refnorm]="--set model.norm_implementation=\"reference\""
# Not FP8 either: the quality checks of the bf16 residual stream and of the fused uvqk kernel.
V[bf16res]="--set precision.residual_dtype=\"bfloat16\""
V[uvqk]="--set model.uvqk_implementation=\"auto\""
# Seed-major, so a run cut short still holds every recipe of its first seeds (pairs against bf16).
for seed in ${SEEDS:-0 1 2}; do
  for recipe in ${RECIPES:-bf16 delayed margin1}; do
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 2; done
    name=${recipe}_s$seed
    eval timeout -k 10 $LIMIT python3 -m experiments train --config configs/gem_h200.toml --workdir $R/$name \
      --set train.steps=$STEPS --set train.eval_batches=0 --set data.num_workers=$W --set train.seed=$seed \
      --set train.progress=false ${V[$recipe]} > $L/$name.log 2>&1 &
  done
done
wait
trap - TERM INT
finish
