#!/usr/bin/env bash
# benches/smollm2_vs_peft.sh — the shipped recipe (configs/smollm2-135m-lora.toml) against PEFT on the
# very same tokenized rows, one after the other; prints tokens/s and peak RSS of each and the ratios.
#
#   benches/smollm2_vs_peft.sh                 # 100 steps, as configured (f32, dropout 0.05, r 16, ...)
#   STEPS=3 benches/smollm2_vs_peft.sh         # a smoke test
#   DTYPE=bf16-autocast benches/smollm2_vs_peft.sh   # both sides in bf16 autocast
#
# rtune runs the config as is (default gradient checkpointing, i.e. "auto"), with only
# train.steps, output.dir and (DTYPE) model.dtype overridden. PEFT (benches/peft_rows.py) trains on
# `rtune data inspect --json` of the same config — the rows as rtune sees them — with the same LoRA,
# optimizer, schedule, clipping, micro-batch and seed, f32, no checkpointing (PEFT's default), on
# the model rtune converts from the GGUF (`rtune convert gguf`, f32 safetensors). tokens/s on both
# sides: median over the steps after the first of non-padding tokens / step time; peak RSS: each
# process's peak resident set. The two runs do not overlap (torch's threads spin-wait; run it on
# an idle machine).
#
# Environment: PYTHON (a python with torch, transformers, peft; default python3), RTUNE (the binary;
# default target/release/rtune, built if missing), STEPS (100), DTYPE (the config's), OUT
# (runs/bench-smollm2: rows, the converted model, both JSON records).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-100}
CONFIG=configs/smollm2-135m-lora.toml
out=${OUT:-runs/bench-smollm2}
mkdir -p "$out"
if [ -z "${RTUNE:-}" ]; then
  RTUNE=target/release/rtune
  [ -x "$RTUNE" ] || cargo build --release --quiet
fi
scripts/fetch-smollm2.sh
gguf=$(sed -n 's/^path *= *"\(.*\)"/\1/p' "$CONFIG" | head -1)
hf=$out/smollm2-hf
if [ ! -f "$hf/config.json" ]; then
  rm -rf "$hf"
  "$RTUNE" convert gguf "$gguf" "$hf"
fi
sets=(--set "train.steps=$STEPS" --set "output.dir=$out/rtune-run" --set output.overwrite=true)
peft_flags=()
if [ -n "${DTYPE:-}" ]; then
  sets+=(--set "model.dtype=$DTYPE")
  case "$DTYPE" in
    f32) ;;
    bf16-autocast) peft_flags+=(--bf16-autocast) ;;
    *) echo "error: DTYPE=$DTYPE: the PEFT side knows f32 and bf16-autocast" >&2; exit 2 ;;
  esac
fi
# Warmup as configured, but shorter than a smoke run.
warmup=$(sed -n 's/^warmup_steps *= *\([0-9]*\).*/\1/p' "$CONFIG" | head -1)
warmup=${warmup:-0}
[ "$warmup" -lt "$STEPS" ] || warmup=$((STEPS - 1))
sets+=(--set "train.warmup_steps=$warmup")

"$RTUNE" data inspect --config "$CONFIG" --json -n 1000000000 > "$out/rows.jsonl"
echo "rows: $(wc -l < "$out/rows.jsonl") from $CONFIG"
"$RTUNE" train --config "$CONFIG" "${sets[@]}" > "$out/rtune.log" 2>&1 \
  || { tail -20 "$out/rtune.log"; exit 1; }
cp "$out/rtune-run/summary.json" "$out/rtune.json"
num() { sed -n "s/^$1 *= *\([0-9.e-]*\).*/\1/p" "$CONFIG" | head -1; }
"$PYTHON" benches/peft_rows.py --model "$hf" --rows "$out/rows.jsonl" --steps "$STEPS" \
  --batch "$(num micro_batch_size)" --r "$(num r)" --alpha "$(num alpha)" --dropout "$(num dropout)" \
  --lr "$(num lr)" --warmup "$warmup" --max-grad-norm "$(num max_grad_norm)" --seed "$(num seed)" \
  "${peft_flags[@]}" --json-out "$out/peft.json" > "$out/peft.log" 2>&1 \
  || { tail -20 "$out/peft.log"; exit 1; }
"$PYTHON" - "$out" "$STEPS" "${DTYPE:-as configured}" <<'PY'
import json, sys
d, steps, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
r, p = json.load(open(f"{d}/rtune.json")), json.load(open(f"{d}/peft.json"))
rt, rm = r["tokens_per_s"], r["peak_memory_bytes"]
pt, pm = p["tokens_per_s"], p["peak_rss_bytes"]
print(f"SmolLM2-135M recipe, {steps} steps, dtype {dtype}")
print(f"rtune  {rt:8.1f} tokens/s  peak RSS {rm/1e9:.2f} GB  final loss {r['final_loss']:.4f}")
print(f"PEFT   {pt:8.1f} tokens/s  peak RSS {pm/1e9:.2f} GB  final loss {p['final_loss']:.4f}")
print(f"rtune / PEFT: {rt/pt:.2f}x tokens/s, {rm/pm:.2f}x peak RSS")
PY
