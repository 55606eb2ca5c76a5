#!/usr/bin/env bash
# benches/grpo_step_vs_trl.sh — whole GRPO steps (sample, score, train), rtune against TRL 1.16's
# GRPOTrainer on the same prompts.
#
# Both sides: the recipe (configs/smollm2-135m-grpo.toml): SmolLM2-135M-Instruct f32, LoRA r 16
# α 32 all-linear, no dropout; the first 2·STEPS prompts of data/arith-train.jsonl in file order
# (conversational, the model's chat template), 2 prompts × 8 completions a step, max_completion_length
# 32, temperature 0.7, loss dapo, β 0, lr 5e-4 constant, the format and answer rewards (TRL's as
# Python functions scoring as rtune's built-ins do). TRL generates with transformers' `generate`
# (no vLLM), torch threads = THREADS (default 2). STEPS default 4; the first step is left out of the
# rates (warm-up). Prints per side: seconds per step, tokens/s (prompt + completion tokens of the
# steps after the first over their time), mean completion length, and the process's peak RSS
# (`/usr/bin/time -v`); then the ratios. The completions are sampled by each side (different
# RNGs): compare tokens/s, and the mean completion lengths say how alike the work was.
# Gradient checkpointing: CKPT=true|false sets it on both sides; unset, each side keeps its default
# (TRL's GRPOConfig: on; rtune: auto, which is off for this small run), so the peak RSS compare
# checkpointed TRL with un-checkpointed rtune.
#
#   PYTHON=/work/.venv-ref/bin/python benches/grpo_step_vs_trl.sh
#
# MODEL_DIR as in benches/grpo_sampling.sh. Needs a release build and scripts/fetch-smollm2.sh's model.
set -euo pipefail
cd "$(dirname "$0")/.."

steps=${STEPS:-4}
threads=${THREADS:-2}
ckpt=${CKPT:-}
case "$ckpt" in "" | true | false) ;; *) echo "CKPT must be true or false, not '$ckpt'" >&2; exit 2 ;; esac
rtune_ckpt=()
[ -n "$ckpt" ] && rtune_ckpt=(--set "train.gradient_checkpointing=$ckpt")
python=${PYTHON:-python3}
bin=${RTUNE:-target/release/rtune}
cache=${RTUNE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rtune}
model=${MODEL_DIR:-$cache/models/b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
head -n $((2 * steps)) data/arith-train.jsonl >"$tmp/prompts.jsonl"

# Not trl.py: a script of that name would shadow the trl package it imports.
cat >"$tmp/trl_grpo.py" <<'PY'
import json, math, os, re, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model_dir, data, out, steps, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
# "": GRPOConfig's default (gradient checkpointing on).
ckpt = {} if sys.argv[6] == "" else {"gradient_checkpointing": sys.argv[6] == "true"}
torch.set_num_threads(threads)
rows = [json.loads(l) for l in open(data)]
FORMAT = re.compile(r"<answer>\s*-?\d+\s*</answer>")
EXTRACT = re.compile(r"(?s)<answer>\s*(.*?)\s*</answer>")

def text(c):
    return c[-1]["content"] if isinstance(c, list) else c

def format_reward(prompts, completions, **kw):
    return [float(bool(FORMAT.search(text(c)))) for c in completions]

def answer_reward(prompts, completions, answer, **kw):
    out = []
    for c, want in zip(completions, answer):
        m = list(EXTRACT.finditer(text(c)))
        try:
            out.append(float(bool(m) and abs(float(m[-1].group(1)) - float(want)) <= 0.0))
        except ValueError:
            out.append(0.0)
    return out

class Clock(TrainerCallback):
    ends = []
    def on_step_end(self, args, state, control, **kw):
        Clock.ends.append(time.perf_counter())

tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
args = GRPOConfig(output_dir=out, per_device_train_batch_size=16, gradient_accumulation_steps=1,
                  num_generations=8, max_completion_length=32, temperature=0.7, learning_rate=5e-4,
                  lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=steps, beta=0.0,
                  loss_type="dapo", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                  bf16=False, shuffle_dataset=False, seed=42, reward_weights=[0.5, 1.0], **ckpt)
t = GRPOTrainer(model=model, processing_class=tok, args=args, train_dataset=Dataset.from_list(rows),
                reward_funcs=[format_reward, answer_reward], callbacks=[Clock()],
                peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
start = time.perf_counter()
t.train()
logs = [h for h in t.state.log_history if "num_tokens" in h]
ends = [start] + Clock.ends
secs = ends[-1] - ends[1]
toks = logs[-1]["num_tokens"] - logs[0]["num_tokens"]
print(json.dumps({"side": "trl", "steps": len(Clock.ends), "s_per_step": round(secs / (len(ends) - 2), 2),
                  "tokens_per_s": round(toks / secs, 1),
                  "mean_completion": round(sum(h["completions/mean_length"] for h in logs) / len(logs), 1),
                  "reward": [round(h["reward"], 3) for h in logs]}))
PY

echo "uptime: $(uptime)"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
/usr/bin/time -v -o "$tmp/rtune.time" "$bin" train --config configs/smollm2-135m-grpo.toml \
  --set "data.train=$tmp/prompts.jsonl" --set data.shuffle=false --set "train.steps=$steps" \
  --set "output.dir=$tmp/rtune" --set output.save_every=0 "${rtune_ckpt[@]}" >"$tmp/rtune.log" 2>&1 ||
  { cat "$tmp/rtune.log" >&2; exit 1; }
python3 - "$tmp/rtune/metrics.jsonl" <<'PY' | tee "$tmp/rtune.json"
import json, sys
m = [json.loads(l) for l in open(sys.argv[1])]
secs = m[-1]["elapsed_s"] - m[0]["elapsed_s"]
toks = sum(x["tokens"] for x in m[1:])
print(json.dumps({"side": "rtune", "steps": len(m), "s_per_step": round(secs / (len(m) - 1), 2),
                  "tokens_per_s": round(toks / secs, 1),
                  "mean_completion": round(sum(x["completions/mean_length"] for x in m) / len(m), 1),
                  "reward": [round(x["reward"], 3) for x in m]}))
PY
/usr/bin/time -v -o "$tmp/trl.time" "$python" "$tmp/trl_grpo.py" "$model" "$tmp/prompts.jsonl" "$tmp/trl" \
  "$steps" "$threads" "$ckpt" 2>"$tmp/trl.log" | tail -1 | tee "$tmp/trl.json" ||
  { cat "$tmp/trl.log" >&2; exit 1; }
python3 - "$tmp" <<'PY'
import json, re, sys
d = sys.argv[1]
rss = {s: int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{d}/{s}.time").read())[1]) * 1024
       for s in ("rtune", "trl")}
r, t = (json.load(open(f"{d}/{s}.json")) for s in ("rtune", "trl"))
print(f"peak RSS: rtune {rss['rtune'] / 1e6:.1f} MB, TRL {rss['trl'] / 1e6:.1f} MB, rtune/TRL {rss['rtune'] / rss['trl']:.2f}")
print(f"tokens/s: rtune {r['tokens_per_s']}, TRL {t['tokens_per_s']}, rtune/TRL {r['tokens_per_s'] / t['tokens_per_s']:.2f}x; "
      f"s/step: rtune {r['s_per_step']}, TRL {t['s_per_step']}")
PY
echo "uptime: $(uptime)"
