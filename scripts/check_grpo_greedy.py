#!/usr/bin/env python3
"""GRPO's greedy sampling (`top_k = 1`) against transformers' greedy `generate`, token for token, on
the recipe's model (SmolLM2-135M-Instruct; not in CI: needs torch and the 500 MB model; the tiny
fixtures' check is crates/model/src/model/decode/tests.rs against tests/parity/golden_greedy.json).

  python3 data/make_arith.py && scripts/fetch-smollm2.sh
  /work/.venv-ref/bin/python scripts/check_grpo_greedy.py --config configs/smollm2-135m-grpo.toml \\
      --hf-model ~/.cache/rtune/models/b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

1. `rtune train` runs the config for one step with `top_k = 1` (every completion is the argmax at
   each position), `num_generations = 2`, `micro_batch_size = 2 × --prompts`, unshuffled, into a
   temporary run directory: rollouts.jsonl holds each prompt's ids and its completions' ids as
   sampled with the fresh adapter (B = 0: the base model's greedy continuation), batched and
   left-padded in rtune's KV-cache decoding.
2. transformers (`--hf-model`: the f32 Hugging Face directory of the same weights, the copy rtune
   dequantizes into its cache, or `rtune convert`'s) runs `generate(do_sample=False)` on each
   prompt's ids alone, with its KV cache, eager attention, f32, `max_new_tokens` =
   `max_completion_length`, stopping at `eos_token_id` (rtune's stop token for this template).
3. Both completions of each prompt must equal transformers' tokens, stop token included.
Prints per prompt the lengths and the smallest gap between the best and the second-best logit
transformers saw (a gap near 1e-5 would be a tie that f32 rounding may break either way). Exit 1
on any difference.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--hf-model", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rtune", default="target/release/rtune")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    with tempfile.TemporaryDirectory() as tmp:
        sets = {"train.steps": 1, "train.top_k": 1, "train.temperature": 1.0,
                "train.num_generations": 2, "train.micro_batch_size": 2 * a.prompts,
                "train.grad_accum": 1, "data.shuffle": "false", "output.dir": f"{tmp}/run"}
        cmd = [a.rtune, "train", "--config", a.config]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(f"{tmp}/run/rollouts.jsonl") as f:
            rows = [json.loads(line) for line in f]
    groups = {}
    for r in rows:
        groups.setdefault(r["prompt_index"], []).append(r)

    model = AutoModelForCausalLM.from_pretrained(a.hf_model, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with open(a.config, "rb") as f:
        max_new = tomllib.load(f)["train"].get("max_completion_length", 512)
    bad = 0
    for i, rs in sorted(groups.items()):
        prompt = rs[0]["prompt_ids"]
        with torch.no_grad():
            g = model.generate(input_ids=torch.tensor([prompt]), do_sample=False,
                               max_new_tokens=max_new, eos_token_id=model.config.eos_token_id,
                               pad_token_id=model.config.eos_token_id, output_logits=True,
                               return_dict_in_generate=True, top_k=None, top_p=None, temperature=None)
        want = g.sequences[0, len(prompt):].tolist()
        gap = min(float(top[0, 0] - top[0, 1]) for top in (s.topk(2, dim=-1).values for s in g.logits))
        same = all(r["completion_ids"] == want for r in rs)
        bad += not same
        print(json.dumps({"prompt_index": i, "prompt_tokens": len(prompt), "tokens": len(want),
                          "equal": same, "min_logit_gap": round(gap, 5)}))
        if not same:
            for r in rs:
                print(f"  rtune:        {r['completion_ids']}\n  transformers: {want}", file=sys.stderr)
    print(f"{len(groups) - bad}/{len(groups)} prompts: rtune's greedy GRPO completions equal transformers' greedy generate")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
