#!/usr/bin/env bash
# Session 11 call 4 (issue 27): the tree with the input norm writing bf16 for the uvqk GEMM and the Triton dQ
# kernel writing every position-gradient slot once (no zeroed buffer). A fuzz of the attention kernels first,
# then the gem_h200 profile, then gem_h200 `train` end to end for 100 s.
set -u
python3 -m pip install -q --no-deps .whl/*.whl > /tmp/pip.log 2>&1; python3 -c "import grain" || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD
mkdir -p $OUT/r
( time timeout -k 10 100 python3 -m experiments fuzz attention --seconds 75 --seed 12 ) > $OUT/r/fuzz.log 2>&1
( time timeout -k 10 100 python3 -m experiments profile --config configs/gem_h200.toml --steps 3 --warmup 2 --batches 2 \
    --pipeline-batches 24 --out /tmp/pg --top 80 ) > $OUT/r/gem_profile.log 2>&1
mkdir -p $OUT/r/pg; cp /tmp/pg/*.csv $OUT/r/pg/ 2>/dev/null
( time timeout -k 10 100 python3 -m experiments train --config configs/gem_h200.toml --workdir /tmp/gem --set train.steps=100000 \
    --set train.log_every=20 --set train.progress=false --set train.checkpoint_every=0 ) > $OUT/r/train_gem_h200.log 2>&1
cp /tmp/gem/metrics.jsonl $OUT/r/train_gem_h200_metrics.jsonl 2>/dev/null
tar -C $OUT -czf $OUT/call4.tgz r && rm -rf $OUT/r
