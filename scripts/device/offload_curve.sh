#!/usr/bin/env bash
# gem_h200 with a 16M-row (8 GiB) item table: in HBM, and offloaded to host memory with an HBM cache of the
# given fractions of its rows. A long warm-up of fresh batches fills the small caches, so their timed steps
# evict (the steady state of a long run). Each point is one process, its log in $OUT.
#   bash scripts/device/offload_curve.sh hbm 0.1 0.05:300   (points: "hbm" or cache fractions; ":W" sets that
#   point's warm-up steps, default $W). ROWS (default 16777216: 8 GiB) sizes the item table of every point;
#   HBM_GIB caps the offloaded points' whole device memory (XLA_PYTHON_CLIENT_MEM_FRACTION of the H200's
#   ~140 GiB) and the planner's budget; PROCESS_GIB (default HBM_GIB) caps the process's device memory apart:
#   ROWS=125829120 HBM_GIB=16 PROCESS_GIB=56 is a 60 GiB table under a 16 GiB table budget, in a process that
#   may not hold more than 56 GiB (gem_h200's step alone needs ~35 GiB of activations).
# then, here: python -m experiments.plots offload DIR/*.log --out docs/offload_curve.png
set -u  # on a GPU host with the package installed: pip install -e '.[cuda]'
OUT=${OUT:-runs/offload_curve}; mkdir -p "$OUT"  # where the logs go
export PYTHONPATH=$PWD
W=${W:-100}; S=${S:-16}; LIMIT=${LIMIT:-270}; ROWS=${ROWS:-16777216}; HBM_GIB=${HBM_GIB:-}
PROCESS_GIB=${PROCESS_GIB:-$HBM_GIB}
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > "$OUT/smi.txt"
TABLES=(
  --set 'embeddings.tables.actions={rows=16, dim=128}'
  --set 'embeddings.tables.sparse={rows=1048576, dim=128}'
  --set "embeddings.features.items={table='items', pooling='none'}"
  --set "embeddings.features.actions={table='actions', pooling='none'}"
  --set "embeddings.features.sparse={table='sparse', pooling='mean'}"
  --set data.num_items=$((ROWS - 1))
)
names=()
for spec in "$@"; do
  point=${spec%%:*}; w=$W; [ "$spec" != "$point" ] && w=${spec#*:}; B=$((w + 2 * S)); names+=("$point")
  cap=()
  if [ "$point" = hbm ]; then items="{rows=$ROWS, dim=128}"; else
    items="{rows=$ROWS, dim=128, sharding='offload', cache_fraction=$point}"
    if [ -n "$HBM_GIB" ]; then cap=(--set "embeddings.device_memory_gib=$HBM_GIB"); fi
  fi
  fraction=$(python3 -c "print(min(0.95, float('${PROCESS_GIB:-0}') / 140) if '$point' != 'hbm' and '${PROCESS_GIB}' else 0.75)")
  start=$(date +%s)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction timeout -k 10 "$LIMIT" python3 -m experiments bench train_step \
    --config configs/gem_h200.toml "${TABLES[@]}" "${cap[@]}" \
    --set "embeddings.tables.items=$items" --batches $B --pipeline-steps $B --warmup $w --steps $S > "$OUT/$point.log" 2>&1
  echo "$point rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/times.txt"
done
python3 scripts/device/offload_table.py "$OUT" "${names[@]}"
