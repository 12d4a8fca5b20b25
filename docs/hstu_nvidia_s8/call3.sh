#!/usr/bin/env bash
# Session 8 call 3: the pipeline with workers drawing whole blocks; hstu_nvidia `train` end to end (issue 27).
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
git log --oneline -1 > $OUT/tree3.txt 2>/dev/null
timeout -k 5 45 python3 -m experiments bench pipeline --config configs/hstu_nvidia.toml --batches 48 > $OUT/pipe_hstu.log 2>&1
( time timeout -s KILL 230 python3 -m experiments train --config configs/hstu_nvidia.toml --workdir /tmp/hn --set train.steps=100000 --set train.log_every=20 --set train.progress=false ) > $OUT/train_hstu.log 2>&1
cp /tmp/hn/metrics.jsonl $OUT/train_hstu_metrics.jsonl
timeout -k 5 45 python3 -m experiments bench pipeline --config configs/gem_h200.toml --batches 48 > $OUT/pipe_gem.log 2>&1
( time timeout -s KILL 90 python3 -m experiments train --config configs/gem_h200.toml --workdir /tmp/gh --set train.steps=100000 --set train.log_every=20 --set train.progress=false --set train.checkpoint_every=0 ) > $OUT/train_gem.log 2>&1
cp /tmp/gh/metrics.jsonl $OUT/train_gem_metrics.jsonl
