#!/usr/bin/env bash
# benches/gpu/run.sh — the one prepared script for a device `run` call on the lent H200 (README.md here).
#
#   device run: command "bash benches/gpu/run.sh", carry ["benches/gpu/bin", ".whl"], timeout_s 600
#   bash benches/gpu/run.sh --quick      # smoke call: 4 layers, seq 1024, 3 steps (< 4 min)
#   bash benches/gpu/run.sh --dry-run    # this machine, no GPU: the CPU binary, small shapes (2-15 min)
#   bash benches/gpu/run.sh --toggles    # each fast path's share: the 8B bench with it off (< 9 min)
#   bash benches/gpu/run.sh --toggles --quick   # the same on 4 layers, seq 1024, 3 steps (< 4 min)
#
# In order, each under its own time limit (a failure or timeout is recorded and the rest still run):
#   1. rtune selftest (every check prints and is recorded even when one fails);
#   2. a tiny rtune bench (bench-small shape, bf16 + NF4, checkpointing): the bench works on the device;
#   3. the 8B QLoRA rtune bench (seq 2048, batch 1, r 16, bf16, NF4, checkpointing);
#   4. PEFT + bitsandbytes on the same shape (bench_peft_gpu.py);
#   5. the roofline (gpu_roofline.py): copy GB/s, GEMM TFLOP/s, bnb NF4 dequant.
#   6. (--toggles; the dry run too) the fast paths of issue 48 one at a time: the same rtune bench
#      with RTUNE_UNFUSED=<name> for each name of TOGGLES, then RTUNE_UNFUSED=all. Each one's share
#      of the step is its bench's step time against step 3's (all on), in the report's toggle table.
#      --toggles runs steps 3 and 6 only (the other steps are recorded as skipped); a name this
#      binary does not have (the bench refuses it before building anything) is recorded as skipped.
# Then report.py prints the table and writes ONE report, $OUT/report.json: a section per step (its
# JSON, or {"skipped": why} / {"status": ...} when it gave none), the steps' outcomes, the summary.
# The step files (selftest/rtune_tiny/rtune/peft/roofline.json, summary.json, run.log) stay beside it.
# The whole script stays under RUN_BUDGET_S (470 s full; 240 quick; 900 dry run): each step's limit is
# clipped to what is left. Exit 1 if a step failed or timed out; goals not met are results, not failures.
#
# --dry-run runs the same script end to end on a CPU: DEVICE=cpu, the CPU binary (target/release/rtune,
# else target/debug/rtune, or $RTUNE), `selftest --device cpu` (training-step parity CPU against CPU),
# small shapes for both benches (the bench_peft_gpu.py "tiny" widths); PEFT and the roofline run on the
# CPU when `import torch, peft` works here, else their sections say {"skipped": "no torch"}.
#
# Env: DEVICE (cuda:0), PRESET (llama3-8b), RTUNE (benches/gpu/bin/rtune), PYTHON (python3),
#   OUT (runs/gpu), RUN_BUDGET_S (seconds for the whole script), RTUNE_ONLY=1 (steps 1-3 only: a
#   first call on a card that has never run rtune, cheap enough to leave time for a fix and a rerun),
#   PYTHON_ONLY=1 (steps 4-5 only, the second half of such a pair), TOGGLES (the RTUNE_UNFUSED
#   names of step 6, in order: issue 48's items 1-4, cuDNN attention, the bf16 LoRA branch, the
#   fused residual add + RMSNorm, grouped NF4; `ce_softcap` only changes a soft-capped model).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=full toggles=0
for arg in "$@"; do
  case "$arg" in
    --quick) mode=quick ;;
    --dry-run) mode=dry ;;
    --toggles) toggles=1 ;;
    *) echo "usage: run.sh [--quick | --dry-run] [--toggles]" >&2; exit 2 ;;
  esac
done
[ $mode = dry ] && toggles=1
TOGGLES=${TOGGLES:-cudnn lora_bf16 add_norm nf4_group}
OUT=${OUT:-$PWD/runs/gpu}
mkdir -p "$OUT"
# no stale result from an earlier local run
rm -f "$OUT"/{selftest,rtune_tiny,rtune,peft,roofline,summary,report}.json "$OUT"/unfused_*.json \
  "$OUT"/unfused_*.log "$OUT/steps.tsv"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

RUN_COMMON=(--batch 1 --r 16)
TINY=(--preset bench-small --seq 256 --steps 3 --warmup 1)
case $mode in
  full)
    DEVICE=${DEVICE:-cuda:0}; PRESET=${PRESET:-llama3-8b}; RTUNE=${RTUNE:-benches/gpu/bin/rtune}
    SHAPE=(--preset "$PRESET"); SEQ=2048; STEPS=10; WARMUP=3; BUDGET=${RUN_BUDGET_S:-470}
    T_SELF=60; T_TINY=40; T_RTUNE=160; T_PEFT=150; T_ROOF=45 ;;
  quick)
    DEVICE=${DEVICE:-cuda:0}; PRESET=${PRESET:-llama3-8b}; RTUNE=${RTUNE:-benches/gpu/bin/rtune}
    SHAPE=(--preset "$PRESET" --layers 4); SEQ=1024; STEPS=3; WARMUP=1; BUDGET=${RUN_BUDGET_S:-240}
    T_SELF=50; T_TINY=30; T_RTUNE=70; T_PEFT=90; T_ROOF=30 ;;
  dry)
    DEVICE=cpu; PRESET=tiny
    if [ -z "${RTUNE:-}" ]; then
      RTUNE=target/release/rtune; [ -x "$RTUNE" ] || RTUNE=target/debug/rtune
    fi
    # bench_peft_gpu.py's "tiny" widths (rtune bench takes them as flags), 3 layers: a small 8B stand-in.
    SHAPE=(--hidden 128 --layers 3 --heads 4 --kv-heads 2 --intermediate 384 --vocab 1024)
    TINY=(--hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256 --seq 32 --steps 2 --warmup 1)
    # The dry run tests the script, not the speed: limits wide enough for a loaded 2-core box (where
    # `import torch` alone took 150 s and the CPU selftest over 75 s, so 240 s left no step but one).
    SEQ=128; STEPS=2; WARMUP=1; BUDGET=${RUN_BUDGET_S:-900}
    T_SELF=240; T_TINY=90; T_RTUNE=150; T_PEFT=240; T_ROOF=150 ;;
esac
# --toggles on a card: rtune's bench and one per toggle (each builds the model anew: ~5 benches),
# fewer timed steps; T_RTUNE is each bench's limit.
if [ $toggles = 1 ] && [ $mode = full ]; then
  STEPS=4; WARMUP=2; BUDGET=${RUN_BUDGET_S:-540}; T_RTUNE=85
elif [ $toggles = 1 ] && [ $mode = quick ]; then
  BUDGET=${RUN_BUDGET_S:-230}; T_RTUNE=35
fi
RUN=(--seq "$SEQ" "${RUN_COMMON[@]}" --steps "$STEPS" --warmup "$WARMUP")

failed=0
# step NAME FILE LIMIT_S CMD...: runs CMD under `timeout`, clipped to what is left of BUDGET; the
# outcome goes to steps.tsv (name, file, status, seconds) for the report.
step() {
  local name=$1 file=$2 limit=$3 t0=$SECONDS rc=0 how=ok left
  shift 3
  left=$((BUDGET - SECONDS - 15))   # 15 s kept for the report
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 10 ]; then
    echo "=== $name: SKIPPED, budget spent ==="
    printf '%s\t%s\t%s\t%s\n' "$name" "$file" "skipped: budget spent" 0 >> "$OUT/steps.tsv"
    failed=1; return 0
  fi
  echo; echo "=== $name (limit ${limit}s, at ${SECONDS}s): $* ==="
  timeout -k 5 "$limit" "$@" || rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then how="TIMEOUT"; elif [ $rc -ne 0 ]; then how="FAILED rc=$rc"; fi
  [ $rc -eq 0 ] || failed=1
  echo "=== $name: $how after $((SECONDS - t0))s ==="
  printf '%s\t%s\t%s\t%s\n' "$name" "$file" "$how" $((SECONDS - t0)) >> "$OUT/steps.tsv"
}
# skip NAME FILE WHY: a step not run for a known reason (not a failure).
skip() {
  echo "=== $1: skipped: $3 ==="
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "skipped: $3" 0 >> "$OUT/steps.tsv"
}
# toggle NAME: step 3's bench with the fast path NAME off (RTUNE_UNFUSED=NAME) into
# unfused_NAME.json. The bench refuses a name its build lacks before anything else (even before
# checking `--steps 0`): probed so, such a name is a skip, not a failure.
toggle() {
  local n=$1 probe
  probe=$(RTUNE_UNFUSED=$n "$RTUNE" bench --steps 0 2>&1 || true)
  case $probe in
    *"unknown name"*) skip "rtune bench unfused=$n" "unfused_$n.json" "not in this build"; return 0 ;;
  esac
  step "rtune bench unfused=$n" "unfused_$n.json" "$T_RTUNE" env RTUNE_UNFUSED="$n" "$RTUNE" bench \
    --device "$DEVICE" "${SHAPE[@]}" --dtype bf16 --quantize nf4 "${RUN[@]}" --gradient-checkpointing \
    --json-out "$OUT/unfused_$n.json"
}

main() {
  echo "rtune GPU bench $(date -u +%FT%TZ), mode $mode, device $DEVICE," \
    "git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  if [ $mode != dry ]; then
    nvidia-smi || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
      --format=csv 2>/dev/null || true

    # rtune (cudarc, dynamically linked) needs libcublas/cublasLt/curand/cudart/nvrtc .so.13: take the
    # ones torch's cu130 install brings (site-packages/nvidia/cu13/lib on that image); env.sh also
    # unpacks the binary, which travels xz-compressed (63 MB stripped, mostly candle's PTX; 9 MB).
    . benches/gpu/env.sh
    echo "CUDA libraries from torch's install: ${nvlibs:-none found}"
    # bitsandbytes travels as a wheel (fetch-wheels.sh).
    if compgen -G ".whl/*.whl" >/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
  fi

  local have_torch=0 peft_quant=()
  if "$PY" -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "peft", peft.__version__)'; then
    have_torch=1
    # Without bitsandbytes PEFT runs on a bf16 base, labelled so (on the CPU: always, bnb's CPU path is slow).
    if [ $mode = dry ] || ! "$PY" -c 'import bitsandbytes' 2>/dev/null; then
      [ $mode = dry ] || echo "WARNING: no bitsandbytes (run benches/gpu/fetch-wheels.sh here and carry .whl): PEFT on a bf16 base"
      peft_quant=(--no-quant)
    fi
  else
    echo "no torch/transformers/peft importable with $PY: the PEFT and roofline sections are skipped"
  fi

  local have_rtune=0
  if [ -f "$RTUNE" ]; then
    chmod +x "$RTUNE" 2>/dev/null || true
    have_rtune=1
    echo "$RTUNE: $(du -h "$RTUNE" | cut -f1); unresolved libraries:"
    { ldd "$RTUNE" 2>&1 | grep -i "not found"; } || echo "  none"
  else
    echo "NO $RTUNE: build it with benches/gpu/build.sh (dry run: cargo build) and carry benches/gpu/bin."
    failed=1
  fi

  # 1-3: rtune.
  if [ "${PYTHON_ONLY:-0}" = 1 ]; then
    skip selftest selftest.json "PYTHON_ONLY=1"
    skip "rtune bench tiny" rtune_tiny.json "PYTHON_ONLY=1"
    skip "rtune bench" rtune.json "PYTHON_ONLY=1"
  elif [ $have_rtune = 1 ]; then
    if [ $toggles = 1 ] && [ $mode != dry ]; then
      skip selftest selftest.json "--toggles"
      skip "rtune bench tiny" rtune_tiny.json "--toggles"
    else
      step selftest selftest.json "$T_SELF" "$RTUNE" selftest --device "$DEVICE" --json-out "$OUT/selftest.json"
      step "rtune bench tiny" rtune_tiny.json "$T_TINY" "$RTUNE" bench --device "$DEVICE" "${TINY[@]}" \
        --dtype bf16 --quantize nf4 --gradient-checkpointing --json-out "$OUT/rtune_tiny.json"
    fi
    step "rtune bench" rtune.json "$T_RTUNE" "$RTUNE" bench --device "$DEVICE" "${SHAPE[@]}" --dtype bf16 \
      --quantize nf4 "${RUN[@]}" --gradient-checkpointing --json-out "$OUT/rtune.json"
  else
    skip selftest selftest.json "no rtune binary"
    skip "rtune bench tiny" rtune_tiny.json "no rtune binary"
    skip "rtune bench" rtune.json "no rtune binary"
  fi
  # 4-5: PEFT + bitsandbytes, the roofline.
  if [ $toggles = 1 ] && [ $mode != dry ]; then
    skip "peft bench" peft.json "--toggles"
    skip roofline roofline.json "--toggles"
  elif [ "${RTUNE_ONLY:-0}" = 1 ]; then
    skip "peft bench" peft.json "RTUNE_ONLY=1"
    skip roofline roofline.json "RTUNE_ONLY=1"
  elif [ $have_torch = 1 ]; then
    local threads=() small=()
    [ $mode = dry ] && threads=(--threads 2) && small=(--small --reps 3)
    local peft_shape=("${SHAPE[@]}")
    [ $mode = dry ] && peft_shape=(--preset tiny --layers 3)
    step "peft bench" peft.json "$T_PEFT" "$PY" benches/gpu/bench_peft_gpu.py --device "$DEVICE" "${peft_shape[@]}" \
      "${RUN[@]}" --alpha 32 "${peft_quant[@]}" "${threads[@]}" --json-out "$OUT/peft.json"
    step roofline roofline.json "$T_ROOF" "$PY" benches/gpu/gpu_roofline.py --device "$DEVICE" "${small[@]}" \
      --json-out "$OUT/roofline.json"
  else
    skip "peft bench" peft.json "no torch"
    skip roofline roofline.json "no torch"
  fi

  # 6: each fast path off in turn, then all of them.
  if [ $toggles = 1 ]; then
    if [ $have_rtune = 1 ] && [ "${PYTHON_ONLY:-0}" != 1 ]; then
      for n in $TOGGLES all; do toggle "$n"; done
    else
      for n in $TOGGLES all; do skip "rtune bench unfused=$n" "unfused_$n.json" "no rtune run"; done
    fi
  fi

  echo
  local rep=(--dir "$OUT" --seq "$SEQ" --batch 1 --mode "$mode" --device "$DEVICE" --toggles "$TOGGLES all")
  case $mode in
    full) rep+=(--preset "$PRESET") ;;
    quick) rep+=(--preset "$PRESET" --quick --layers 4) ;;
    dry) rep+=(--preset tiny --quick --layers 3) ;;
  esac
  "$PY" benches/gpu/report.py "${rep[@]}" || failed=1
  echo "total ${SECONDS}s; files in \$OUT: $(cd "$OUT" && echo *)"
  return $failed
}

main 2>&1 | tee "$OUT/run.log"
