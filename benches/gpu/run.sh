#!/usr/bin/env bash
# benches/gpu/run.sh — the one prepared script for a device `run` call on the lent H200 (README.md here).
#
#   device run: command "bash benches/gpu/run.sh", carry ["benches/gpu/bin", ".whl"], timeout_s 600
#   bash benches/gpu/run.sh --quick      # smoke call: 4 layers, seq 1024, 3 steps (< 4 min)
#
# In order, each under its own time limit (a failure or timeout is logged and the rest still run):
# rtune selftest, gpu_roofline.py, rtune bench (8B QLoRA), bench_peft_gpu.py (8B QLoRA); then report.py
# prints the table. Everything lands in $OUT (6 files: run.log, selftest/roofline/rtune/peft/summary.json).
# The whole script stays under RUN_BUDGET_S (470 s; quick 240): a call may run 600 s, and the
# machine's start and the transfers come on top. Exit 1 if a step failed or timed out; goals not met
# are results, not failures.
#
# Env (for a dry run on a machine without a GPU: DEVICE=cpu PRESET=tiny RTUNE=path/to/fake):
#   DEVICE (cuda:0), PRESET (llama3-8b), RTUNE (benches/gpu/bin/rtune), PYTHON (python3), OUT (runs/gpu),
#   RUN_BUDGET_S (seconds for the whole script; the steps' limits are clipped to what is left).
set -euo pipefail
cd "$(dirname "$0")/../.."
quick=0
[ "${1:-}" = "--quick" ] && quick=1
OUT=${OUT:-$PWD/runs/gpu}
mkdir -p "$OUT"
rm -f "$OUT"/{selftest,roofline,rtune,peft,summary}.json   # no stale result from an earlier local run
DEVICE=${DEVICE:-cuda:0}
PRESET=${PRESET:-llama3-8b}
RTUNE=${RTUNE:-benches/gpu/bin/rtune}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# Full: the goal's shape. Quick: same widths, 4 layers, shorter sequence, fewer steps (explicit flags
# override the preset, in rtune bench as in bench_peft_gpu.py).
if [ $quick = 1 ]; then
  SHAPE=(--preset "$PRESET" --layers 4); SEQ=1024; STEPS=3; WARMUP=1
  T_SELF=60; T_ROOF=45; T_RTUNE=90; T_PEFT=120
else
  SHAPE=(--preset "$PRESET"); SEQ=2048; STEPS=10; WARMUP=3
  T_SELF=60; T_ROOF=60; T_RTUNE=180; T_PEFT=150
fi
BUDGET=${RUN_BUDGET_S:-$([ $quick = 1 ] && echo 240 || echo 470)}
RUN=(--seq "$SEQ" --batch 1 --r 16 --steps "$STEPS" --warmup "$WARMUP")

failed=0
summary=()
# step NAME LIMIT_S CMD...: runs CMD under `timeout`, clipped to what is left of BUDGET; records the outcome.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc=0 how=ok left
  shift 2
  left=$((BUDGET - SECONDS - 15))   # 15 s kept for the report
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 15 ]; then
    echo "=== $name: SKIPPED, budget spent ==="; summary+=("$name: skipped (budget)"); failed=1; return 0
  fi
  echo; echo "=== $name (limit ${limit}s, at ${SECONDS}s): $* ==="
  timeout -k 5 "$limit" "$@" || rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then how="TIMEOUT"; elif [ $rc -ne 0 ]; then how="FAILED rc=$rc"; fi
  [ $rc -eq 0 ] || failed=1
  echo "=== $name: $how after $((SECONDS - t0))s ==="
  summary+=("$name: $how ($((SECONDS - t0))s)")
}

main() {
  echo "rtune GPU bench $(date -u +%FT%TZ), mode $([ $quick = 1 ] && echo quick || echo full)," \
    "git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi || echo "nvidia-smi failed"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
    --format=csv 2>/dev/null || true

  # rtune (cudarc, dynamically linked) needs libcublas/cublasLt/curand/cudart/nvrtc .so.13: take the
  # ones torch's cu130 install brings (site-packages/nvidia/cu13/lib on that image).
  local nvlibs
  nvlibs=$("$PY" - <<'PY' || true
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
want = ("libcublas.so", "libcublasLt.so", "libcurand.so", "libcudart.so", "libnvrtc.so")
dirs = []
for root in nvidia.__path__:
    for f in sorted(glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True)):
        if os.path.basename(f).startswith(want) and os.path.dirname(f) not in dirs:
            dirs.append(os.path.dirname(f))
print(":".join(dirs))
PY
)
  echo "CUDA libraries from torch's install: ${nvlibs:-none found}"
  [ -n "$nvlibs" ] && export LD_LIBRARY_PATH="$nvlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

  # bitsandbytes travels as a wheel (fetch-wheels.sh); without it PEFT runs on a bf16 base, labelled so.
  local peft_quant=()
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  if ! "$PY" -c 'import bitsandbytes' 2>/dev/null; then
    echo "WARNING: no bitsandbytes (run benches/gpu/fetch-wheels.sh here and carry .whl): PEFT on a bf16 base"
    peft_quant=(--no-quant)
  fi
  "$PY" -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "peft", peft.__version__)' || true

  # The binary travels xz-compressed (63 MB stripped, mostly candle's PTX; 9 MB compressed).
  if [ ! -f "$RTUNE" ] && [ -f "$RTUNE.xz" ]; then
    "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$RTUNE.xz" /tmp/rtune && RTUNE=/tmp/rtune
  fi
  local have_rtune=0
  if [ -f "$RTUNE" ]; then
    chmod +x "$RTUNE" 2>/dev/null || true
    have_rtune=1
    echo "$RTUNE: $(du -h "$RTUNE" | cut -f1); unresolved libraries:"
    { ldd "$RTUNE" 2>&1 | grep -i "not found"; } || echo "  none"
  else
    echo "NO $RTUNE: build it on the CPU machine with benches/gpu/build.sh and carry benches/gpu/bin."
    echo "Running the Python parts only."
    summary+=("rtune: not built (benches/gpu/build.sh)")
  fi

  if [ $have_rtune = 1 ]; then
    step selftest "$T_SELF" "$RTUNE" selftest --device "$DEVICE" --json-out "$OUT/selftest.json"
  fi
  local small=()
  [ "$DEVICE" = cpu ] && small=(--small --reps 3)
  step roofline "$T_ROOF" "$PY" benches/gpu/gpu_roofline.py --device "$DEVICE" "${small[@]}" --json-out "$OUT/roofline.json"
  if [ $have_rtune = 1 ]; then
    step "rtune bench" "$T_RTUNE" "$RTUNE" bench --device "$DEVICE" "${SHAPE[@]}" --dtype bf16 --quantize nf4 \
      "${RUN[@]}" --gradient-checkpointing --json-out "$OUT/rtune.json"
  fi
  step "peft bench" "$T_PEFT" "$PY" benches/gpu/bench_peft_gpu.py --device "$DEVICE" "${SHAPE[@]}" "${RUN[@]}" \
    --alpha 32 "${peft_quant[@]}" --json-out "$OUT/peft.json"

  echo
  printf '%s\n' "${summary[@]}"
  local rep=(--dir "$OUT" --preset "$PRESET" --seq "$SEQ" --batch 1)
  [ $quick = 1 ] && rep+=(--quick --layers 4)
  "$PY" benches/gpu/report.py "${rep[@]}" || failed=1
  echo "total ${SECONDS}s; files in \$OUT: $(cd "$OUT" && echo *)"
  return $failed
}

main 2>&1 | tee "$OUT/run.log"
