#!/usr/bin/env bash
# gem_h200 with a 16M-row (8 GiB) item table: in HBM, and offloaded to host memory with an HBM cache of the
# given fractions of its rows. A long warm-up of fresh batches fills the small caches, so their timed steps
# evict (the steady state of a long run). One device call; each point is one process, its log in $OUT.
#   bash scripts/device/offload_curve.sh hbm 0.1 0.05:300   (points: "hbm" or cache fractions; ":W" sets that
#   point's warm-up steps, default $W)
# then, here: python -m experiments.plots offload DIR/*.log --out docs/offload_curve.png
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1  # few files come back from a call: $OUT holds the points
export PYTHONPATH=$PWD
W=${W:-100}; S=${S:-16}; LIMIT=${LIMIT:-270}
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > "$OUT/smi.txt"
TABLES=(
  --set 'embeddings.tables.actions={rows=16, dim=128}'
  --set 'embeddings.tables.sparse={rows=1048576, dim=128}'
  --set "embeddings.features.items={table='items', pooling='none'}"
  --set "embeddings.features.actions={table='actions', pooling='none'}"
  --set "embeddings.features.sparse={table='sparse', pooling='mean'}"
  --set data.num_items=16777215
)
names=()
for spec in "$@"; do
  point=${spec%%:*}; w=$W; [ "$spec" != "$point" ] && w=${spec#*:}; B=$((w + 2 * S)); names+=("$point")
  if [ "$point" = hbm ]; then items='{rows=16777216, dim=128}'; else items="{rows=16777216, dim=128, sharding='offload', cache_fraction=$point}"; fi
  start=$(date +%s)
  timeout -k 10 "$LIMIT" python3 -m experiments bench train_step --config configs/gem_h200.toml "${TABLES[@]}" \
    --set "embeddings.tables.items=$items" --batches $B --pipeline-steps $B --warmup $w --steps $S > "$OUT/$point.log" 2>&1
  echo "$point rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
done
python3 scripts/device/offload_table.py "$OUT" "${names[@]}"
