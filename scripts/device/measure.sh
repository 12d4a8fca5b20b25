#!/usr/bin/env bash
# GPU measurements, one PART per invocation: each step runs under its own timeout and writes its log as it
# ends, so a kernel that hangs costs one step. Logs go to $LOGS (default $OUT/logs, OUT default runs/measure),
# packed into $OUT/PART.tgz at the end; $OUT/PART.md holds the tables and the lines to read first.
#   bash scripts/device/measure.sh startup [CONFIG]   the compilation cache: CONFIG (default gem_h200) trained
#                                                 twice in fresh workdirs with one fresh cache folder; the
#                                                 second run loads its step untraced (step_compile_s, startup_s)
#   bash scripts/device/measure.sh train CONFIG [KEY=VALUE ...]  `train` for STEPS steps (default 200) in a
#                                                 fresh workdir: the memory plan, the compile, MFU per window
#   bash scripts/device/measure.sh glue       norm_gemm forward (+ backward) vs XLA; FP8 GEMM result dtype,
#                                                 default XLA flags and with the Triton GEMM fusion off
#   bash scripts/device/measure.sh step       bench train_step, gem_h200 and hstu_nvidia, uvqk unfused vs
#                                                 model.uvqk_implementation=auto (the fused kernel)
#   bash scripts/device/measure.sh bias       the biased Mosaic backward vs Triton (u1k), then the any-T table
#                                                 (u1k, h4k: bias on/off, default T vs padded)
#   bash scripts/device/measure.sh presets    every attention preset (scripts/device/attention_presets.sh)
#   bash scripts/device/measure.sh fuzz       fuzz attention for FUZZ_S seconds (default 540)
#   bash scripts/device/measure.sh norm       bench norm: the layer-norm kernels, Mosaic GPU vs Triton vs XLA
#                                                 (first at 8,192 rows, a small run in its own process)
#   bash scripts/device/measure.sh profile CONFIG [KEY=VALUE ...]  `experiments profile` of one config (3 steps):
#                                                 breakdown.md and the top ops in the summary, all files in the tgz
#   bash scripts/device/measure.sh fp8 [CONFIGS]  bench train_step bf16 vs FP8 for each config (default
#                                                 hstu_nvidia), then every FP8 GEMM form of a layer's three GEMMs
#                                                 (bench fp8_out; FP8_GEMMS=0 skips it)
# PART_BUDGET=S skips a step that could not end within S seconds of the part's start. On a machine without a
# GPU, QUICK=1 runs each part at small sizes (a check of the script; the kernels' rows then say n/a):
# `OUT=/tmp/m QUICK=1 bash scripts/device/measure.sh glue`.
set -u
PART=${1:?usage: measure.sh startup|train|glue|step|bias|presets|fuzz|norm|fp8|profile}
OUT=${OUT:-runs/measure}
LOGS=${LOGS:-$OUT/logs}; mkdir -p "$LOGS" "$OUT"
export PYTHONPATH=$PWD
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$LOGS/pip.log" 2>&1
  export PYTHONPATH=$PWD:/tmp/site
fi
QUICK=${QUICK:-}
start=$(date +%s)
PART_BUDGET=${PART_BUDGET:-}  # seconds for the whole part: a step that might not end within it is skipped (the summary runs)
step() {  # step NAME LIMIT_S COMMAND...: one step, its own timeout, its log in $LOGS/NAME.log
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  if [ -n "$PART_BUDGET" ] && [ $(( t0 - start + limit )) -gt "$PART_BUDGET" ]; then
    echo "$name skipped: $limit s would pass PART_BUDGET=$PART_BUDGET (at $(( t0 - start )) s)" | tee -a "$LOGS/times.txt"
    return
  fi
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s (at $(( $(date +%s) - start )) s)" | tee -a "$LOGS/times.txt"
}
train_steps() {  # train_steps CONFIGS LIMIT_S KEY VALUE...: bench train_step of each config at each value of KEY
  local configs=$1 limit=$2 key=$3; shift 3
  local extra=(--steps 10 --warmup 3)
  [ -n "$QUICK" ] && configs=configs/tiny.toml && extra=(--steps 2 --warmup 1 --pipeline-steps 2)
  for c in $configs; do
    for v in "$@"; do
      step "train_step_$(basename "$c" .toml)_${key##*.}_$v" "$limit" python3 -m experiments bench train_step \
        --config "$c" --set "$key=$v" "${extra[@]}"
    done
  done
}
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > "$LOGS/smi.txt" 2>&1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" > "$LOGS/jax.txt" 2>&1
case $PART in
  startup)
    c=${2:-configs/gem_h200.toml}; n=${STEPS:-20}; [ -n "$QUICK" ] && c=configs/tiny.toml && n=2
    runs=$(mktemp -d /tmp/measure_runs_XXXX)  # workdirs (checkpoints) and the cache stay out of the logs
    for run in first second; do
      step "startup_$run" 900 python3 -m experiments train --config "$c" --workdir "$runs/$run" \
        --set train.steps="$n" --set train.checkpoint_every=0 --set train.compilation_cache="$runs/xla"
    done
    python3 - "$LOGS"/startup_first.log "$LOGS"/startup_second.log > "$LOGS/startup_table.log" 2>&1 <<'PY'
import json, sys
print("| run | step compile | from the cache | traced | trainer start to first step | wall |")
print("| --- | ---: | --- | --- | ---: | ---: |")
for path in sys.argv[1:]:
    s = json.loads([line for line in open(path) if line.startswith("{")][-1])
    print(f"| {path.split('_')[-1][:-4]} | {s['step_compile_s']:.1f} s | {s['step_compile_cached']} | "
          f"{s.get('step_traced')} | {s['startup_s']:.1f} s | {s['wall_time_s']:.1f} s |")
PY
    rm -rf "$runs"
    ;;
  train)
    c=${2:?train CONFIG [KEY=VALUE ...]}; shift 2
    sets=(); for kv in "$@"; do sets+=(--set "$kv"); done
    n=${STEPS:-200}; [ -n "$QUICK" ] && n=2
    name=train_$(basename "$c" .toml)
    runs=$(mktemp -d /tmp/measure_runs_XXXX)
    step "$name" "${LIMIT:-900}" python3 -m experiments train --config "$c" --workdir "$runs/$name" "${sets[@]}" \
      --set train.steps="$n" --set train.log_every=20 --set train.checkpoint_every=0 --set train.progress=false
    cp "$runs/$name/metrics.jsonl" "$LOGS/$name.metrics.jsonl" 2>/dev/null
    python3 - "$LOGS/$name.metrics.jsonl" > "$LOGS/${name}_windows.log" 2>&1 <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line and '"split"' not in line]
print("| step | step time | MFU | MFU (NVIDIA's count) | tokens/s |")
for r in rows[1:]:  # the first window holds the compile
    nv = r.get("mfu_nvidia")
    print(f"| {r['step']} | {r['step_time_s'] * 1e3:.1f} ms | {r['mfu'] or 0:.1%} | {nv or 0:.1%} | {r.get('tokens_per_s', 0):,.0f} |")
PY
    rm -rf "$runs"
    ;;
  glue)
    small=; [ -n "$QUICK" ] && small=--small
    quick=; [ -n "$QUICK" ] && quick=--quick
    step fp8_out 120 python3 -m experiments bench fp8_out --reps 10 $small
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" \
      step fp8_out_no_triton_gemm 100 python3 -m experiments bench fp8_out --reps 10 $small
    # the kernels' first GPU runs: the forward one tile per CTA and the backward first, then the persistent
    # forward (a CTA's hand-over between tiles), each in its own process so that a hang costs one step
    step norm_gemm_one_per_cta 160 python3 -m experiments bench norm_gemm --forward one_per_cta $quick
    step norm_gemm_persistent 160 python3 -m experiments bench norm_gemm --forward default,n128s2,n64s3 \
      --backward none $quick
    ;;
  step)
    train_steps "configs/gem_h200.toml configs/hstu_nvidia.toml" 130 model.uvqk_implementation off auto
    ;;
  bias)
    step bwd_bias1024 200 python3 scripts/device/attention_bwd_sm90.py time bias1024 10
    step table_u1k_h4k 300 python3 scripts/device/attention_table.py u1k h4k --reps 10 --no-triton
    ;;
  presets)
    OUT=$LOGS/presets BUDGET=500 step presets 560 bash scripts/device/attention_presets.sh
    ;;
  fuzz)
    step fuzz "$(( ${FUZZ_S:-540} + 40 ))" python3 -m experiments fuzz attention --seconds "${FUZZ_S:-540}" --seed 5
    ;;
  norm)
    quick=; [ -n "$QUICK" ] && quick=--quick
    # a small run first, in its own process: a kernel that hangs or is wrong costs this step only
    step bench_norm_small 200 python3 -m experiments bench norm --rows 8192 --reps 3 $quick
    step bench_norm 360 python3 -m experiments bench norm --reps 20 $quick
    ;;
  fp8)
    small=; [ -n "$QUICK" ] && small=--small
    train_steps "${2:-configs/hstu_nvidia.toml}" 150 precision.fp8 false true
    [ "${FP8_GEMMS:-1}" = 1 ] && step fp8_out 170 python3 -m experiments bench fp8_out --reps 5 $small
    ;;
  profile)
    c=${2:?profile CONFIG [KEY=VALUE ...]}; shift 2
    sets=(); for kv in "$@"; do sets+=(--set "$kv"); done
    name=profile_$(basename "$c" .toml)$(printf '_%s' "${@##*.}" | tr -c 'A-Za-z0-9_=\n' _)
    steps=3; [ -n "$QUICK" ] && steps=1
    step "$name" 240 python3 -m experiments profile --config "$c" "${sets[@]}" --steps $steps --out "$LOGS/$name"
    ;;
  *) echo "unknown part $PART (startup, train, glue, step, bias, presets, fuzz, norm, fp8, profile)"; exit 2 ;;
esac
{  # the tables and the lines a reader needs first
  echo "# measure.sh $PART, $(date -u +%F), $(head -1 "$LOGS/smi.txt" 2>/dev/null | tail -1), $(cat "$LOGS/jax.txt")"
  cat "$LOGS/times.txt"
  for f in "$LOGS"/*.log; do
    echo; echo "## $(basename "$f")"
    grep -h -E 'memory per device|train step: |tables planned again|does not fit| offload |^\||^ +[0-9]+\.[0-9]+  |^  (kernel|backward|reference|triton|mosaic)|implementation=None|: reference [0-9]|CHECK FAILED|FAIL|WRONG|ROW|failures|Error|"(device_step_s_median|mfu|mfu_nvidia)"|^kernels \(|^  (attention|block attention|layer norm|silu backward fp8|uvqk norm\+gemm): |"(cublas_lt_f8|fp8_pattern|scales_are_arguments)"' "$f" | head -120
  done
} > "$OUT/$PART.md" 2>&1
tar czf "$OUT/$PART.tgz" --exclude=trace --exclude="*.prof" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null
echo "total $(( $(date +%s) - start )) s; $OUT/$PART.md, $OUT/$PART.tgz"
