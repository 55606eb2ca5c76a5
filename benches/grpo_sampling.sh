#!/usr/bin/env bash
# benches/grpo_sampling.sh — sampling one GRPO group: rtune's sampler against transformers'
# `generate` with its KV cache, side by side in one run (issue 44: the target is ≥ 2×).
#
#   PYTHON=/work/.venv-ref/bin/python benches/grpo_sampling.sh
#
# Both sides: SmolLM2-135M-Instruct in f32 with a fresh LoRA r 16 α 32 on every linear layer (B = 0:
# the base's distribution, but the adapter's products computed, as GRPO samples with its live
# adapter; transformers through PEFT), one plain-text prompt (a story opening: the model seldom
# ends it, so the completions run to the limit; the prompt's token ids are rtune's, read from its
# rollouts.jsonl), NUM (default 8) completions of at most LEN (default 128) new tokens, temperature
# 1, no top-k / top-p / min-p, stopping at EOS; THREADS (default 2) threads each.
# - rtune: `rtune train` on configs/smollm2-135m-grpo.toml with one prompt and `micro_batch_size
#   = num_generations = NUM` for ROUNDS steps (default 2); each step samples the group with the KV
#   cache (`Model::complete_rows`: the prompt once, its cache repeated for the group, all rows
#   decoded together) and logs `sampled N completions, T tokens in S s`: the sampling alone.
# - transformers: `generate(do_sample=True)` on a batch of NUM copies of the prompt (no padding),
#   ROUNDS calls, each timed alone.
# Rates are generated tokens (EOS included, nothing after it) over the seconds of one round; the
# last round of each side is compared (the first warms up). The completions differ (each side its
# own RNG): the mean lengths printed say how alike the work was.
#
# MODEL_DIR: the Hugging Face directory of the same weights (default: the f32 copy rtune
# dequantizes the GGUF into on its first run, $RTUNE_CACHE/models/<sha256>). Needs a release build
# and scripts/fetch-smollm2.sh's model.
set -euo pipefail
cd "$(dirname "$0")/.."

num=${NUM:-8}
len=${LEN:-128}
rounds=${ROUNDS:-2}
threads=${THREADS:-2}
python=${PYTHON:-python3}
bin=${RTUNE:-target/release/rtune}
cache=${RTUNE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rtune}
model=${MODEL_DIR:-$cache/models/b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# "answer": the recipe's answer reward reads the column (every completion scores 0 here).
echo '{"prompt": "Once upon a time, in a small village by the sea,", "answer": 0}' >"$tmp/prompts.jsonl"

echo "uptime: $(uptime)"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
RAYON_NUM_THREADS=$threads "$bin" train --config configs/smollm2-135m-grpo.toml \
  --set "data.train=$tmp/prompts.jsonl" --set data.shuffle=false --set "train.steps=$rounds" \
  --set "train.micro_batch_size=$num" --set "train.num_generations=$num" \
  --set "train.max_completion_length=$len" --set "data.max_seq_len=$((len + 32))" \
  --set train.temperature=1.0 --set train.gradient_checkpointing=false \
  --set "output.dir=$tmp/rtune" --set output.save_every=0 >"$tmp/rtune.log" 2>&1 ||
  { cat "$tmp/rtune.log" >&2; exit 1; }
grep 'sampled' "$tmp/rtune.log" | sed 's/^/rtune: /'

"$python" - "$model" "$tmp" "$num" "$len" "$rounds" "$threads" <<'PY'
import json, os, re, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model_dir, tmp, num, n_new, rounds, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
torch.set_num_threads(threads)
torch.manual_seed(0)
first = json.loads(open(f"{tmp}/rtune/rollouts.jsonl").readline())
prompt = first["prompt_ids"]
lines = [json.loads(l) for l in open(f"{tmp}/rtune/rollouts.jsonl")]
rtune_len = [sum(len(l["completion_ids"]) for l in lines if l["step"] == s) / num
             for s in sorted({l["step"] for l in lines})]
log = open(f"{tmp}/rtune.log").read()
rtune = [(int(t), float(s)) for t, s in re.findall(r"sampled \d+ completions, (\d+) tokens in ([\d.]+) s", log)]

base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
model.eval()
eos = base.generation_config.eos_token_id
ids = torch.tensor([prompt] * num)
hf = []
for _ in range(rounds):
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n_new,
                             eos_token_id=eos, pad_token_id=eos, use_cache=True)
        secs = time.perf_counter() - start
    new = out[:, len(prompt):].tolist()
    # Each row's tokens up to its EOS, EOS included (the rest is padding).
    toks = sum(next((i + 1 for i, t in enumerate(r) if t == eos), len(r)) for r in new)
    hf.append((toks, secs))

print(f"prompt: {len(prompt)} tokens; {num} completions of at most {n_new} tokens, {threads} threads")
for name, runs, lens in (("rtune", rtune, rtune_len), ("transformers", hf, [t / num for t, _ in hf])):
    for i, (t, s) in enumerate(runs):
        print(f"{name:12s} round {i + 1}: {t} tokens in {s:.2f} s = {t / s:.1f} tokens/s "
              f"(mean completion {lens[i]:.1f})")
(rt, rs), (ht, hs) = rtune[-1], hf[-1]
print(f"last round: rtune {rt / rs:.1f} tokens/s, transformers {ht / hs:.1f} tokens/s, "
      f"rtune/transformers {(rt / rs) / (ht / hs):.2f}x")
PY
echo "uptime: $(uptime)"
