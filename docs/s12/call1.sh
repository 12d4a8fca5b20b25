#!/usr/bin/env bash
# Session 12 call 1 (issue 30): where the FP8 step's extra time goes (gem_h200 profiles, bf16 and delayed FP8,
# same call), then FP8 quality: bf16 and the delayed recipe with one binade of headroom (margin1), 3 seeds.
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
for v in bf16 fp8; do
  s=""; [ $v = fp8 ] && s="--set precision.fp8=true"
  ( time timeout -k 10 110 python3 -m experiments profile --config configs/gem_h200.toml $s --steps 3 --warmup 2 \
      --batches 2 --pipeline-batches 8 --out /tmp/pg_$v --top 100 ) > $OUT/r/profile_$v.log 2>&1
  mkdir -p $OUT/r/pg_$v; cp /tmp/pg_$v/*.csv /tmp/pg_$v/*.md /tmp/pg_$v/summary.json $OUT/r/pg_$v/ 2>/dev/null
done
tar -C $OUT -czf $OUT/call1.tgz r && rm -rf $OUT/r
RECIPES="bf16 margin1" SEEDS="0 1 2" PARALLEL=3 LIMIT=330 timeout -k 5 350 bash scripts/device/fp8_quality.sh
