#!/usr/bin/env bash
# Session 10 call 4 (issue 27): `train` end to end with the new data.worker_buffer_size default (8): gem_h200 for
# 90 s and hstu_nvidia for 200 s (its 35.45% MFU of 2026-12-03 was measured with grain's buffer of 1).
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
run() {  # name config seconds
  ( time timeout -k 10 $3 python3 -m experiments train --config configs/$2.toml --workdir /tmp/$1 --set train.steps=100000 \
      --set train.log_every=20 --set train.progress=false --set train.checkpoint_every=0 ) > $OUT/r/train_$1.log 2>&1
  cp /tmp/$1/metrics.jsonl $OUT/r/train_$1_metrics.jsonl 2>/dev/null
}
run gem_h200 gem_h200 100
run hstu_nvidia hstu_nvidia 220
tar -C $OUT -czf $OUT/call4.tgz r && rm -rf $OUT/r
