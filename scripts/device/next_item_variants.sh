#!/usr/bin/env bash
# Next-item variants (docs/results.md) trained at the same time on one GPU, each to its early stop or to
# $MIN minutes; logs and a table packed into $OUT/next_item.tgz.
#   bash scripts/device/next_item_variants.sh beauty:config:0 sports:config:0 beauty:allpos:1 ...   (set:variant:seed)
#   bash scripts/device/next_item_variants.sh beauty:tv:0 sports:tv:0 beauty:wave:0 sports:wave:0 beauty:ficl:0 ...
# On a GPU host with the package installed: pip install -e '.[cuda]'.
set -u  # the logs and the table end in one archive
OUT=${OUT:-runs/next_item_variants}; mkdir -p "$OUT"  # where the logs go
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
MIN=${MIN:-6.6}; LIMIT=${LIMIT:-555}
L=/tmp/next_item; R=/tmp/runs; mkdir -p $L $R
# Variants of the shipped config (configs/{beauty,sports}_hstu.toml: prefix training + BSARec's filter):
#   config    as shipped
#   allpos    every position of a sequence trains, no filter (the shipped config before 2026-12-02)
#   nofilter  prefix training without the filter;  freq5  the filter with 5 low-pass bins
#   cl, clfix, intent  contrastive objectives on `allpos` (docs/results.md);  big  4 layers of width 128
declare -A V
V[config]=""
V[allpos]="--set retrieval.train_targets=\\\"all_positions\\\" --set model.frequency_mix=0 --set data.examples_per_shard=128 --set data.tokens_per_shard=2048 --set retrieval.eval_every_epochs=5"
V[nofilter]="--set model.frequency_mix=0"
V[freq5]="--set model.frequency_bins=5"
V[cl]="${V[allpos]} --set retrieval.contrastive_weight=0.1"
V[clfix]="${V[cl]} --set retrieval.contrastive_dropout=false --set retrieval.contrastive_pooling=\\\"mean\\\""
V[intent]="${V[clfix]} --set retrieval.intent_weight=0.1 --set retrieval.intent_clusters=256"
V[big]="--set model.num_layers=4 --set model.model_dim=128 --set embeddings.dim=128 --set model.attention_dim=64 --set model.value_dim=64"
# Options of the model or loss on top of the shipped config (`config` is their control):
TV="--set model.sequence_mixer=\\\"time_variant\\\" --set retrieval.position_embedding=false"
V[tv]="$TV --set model.frequency_mix=0"  # TV-Rec: time-variant filters in place of attention and positions
V[tvfreq]="$TV"  # the same beside the shipped frequency branch (0.7 filter, 0.3 time-variant mixer)
V[tvb16]="${V[tv]} --set model.time_variant_basis=16"  # TV-Rec's Sports basis (Beauty: 32, the default)
V[wave]="--set model.frequency_mix=0 --set model.wavelet_mix=0.7"  # the wavelet branch in place of the FFT filter
V[wavefreq]="--set model.frequency_mix=0.4 --set model.wavelet_mix=0.3"  # both filters beside attention (0.3)
FICL="--set retrieval.contrastive_dropout=false --set retrieval.frequency_contrastive_weight"
V[ficl]="$FICL=0.1"  # frequency-domain contrastive views (band-stop), InfoNCE weight 0.1
V[ficl02]="$FICL=0.02"
V[ficlb2]="$FICL=0.1 --set retrieval.frequency_contrastive_band=0.2"  # a narrower band removed (a milder view)
V[tvficl]="${V[tv]} $FICL=0.1"
V[tvwave]="${V[tv]} --set model.wavelet_mix=0.5"  # the time-variant mixer and the wavelet branch, half each
V[extra]="${EXTRA:-}"  # any other overrides, from the environment
BASE="--set model.attention_implementation=\\\"reference\\\" --set train.max_minutes=$MIN"
if [ "${1:-}" = "--print" ]; then  # each variant's arguments to `experiments train`, one per line after its name
  for v in "${!V[@]}"; do eval "args=( $BASE ${V[$v]} )"; printf '%s' "$v"; printf '\t%s' "${args[@]}"; echo; done
  exit 0
fi
for spec in "$@"; do  # every variant named, before any run starts
  IFS=: read -r ds v seed <<< "$spec"
  [[ -v V[$v] ]] || { echo "unknown variant $v in $spec (one of: ${!V[*]})" >&2; exit 2; }
done
for spec in "$@"; do
  IFS=: read -r ds v seed <<< "$spec"
  name=${ds}_${v}_s$seed
  eval timeout -k 10 $LIMIT python3 -m experiments train --config configs/${ds}_hstu.toml --workdir $R/$name \
    $BASE --set train.seed=$seed --set data.seed=$seed ${V[$v]} > $L/$name.log 2>&1 &
done
sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv > $L/smi.txt; uptime >> $L/smi.txt
wait
python3 scripts/device/next_item_table.py $R | tee $L/summary.txt
for d in $R/*; do mkdir -p $L/runs/$(basename $d); cp $d/test.json $d/metrics.jsonl $L/runs/$(basename $d)/ 2>/dev/null; done
grep -h "stopping\|Error" $L/*.log | sort | uniq -c | head -20
tar czf $OUT/next_item.tgz -C /tmp next_item
