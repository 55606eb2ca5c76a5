#!/usr/bin/env python3
"""Greedy decoding goldens: transformers' `generate` (greedy, its KV cache, a batch of left-padded
prompts of unequal lengths) on every tiny family fixture. Written for rtune; run with the
reference venv from the repository root:

    python tests/parity/make_greedy_goldens.py

Writes tests/parity/golden_greedy.json: per fixture the prompts (token ids, one row each), the
new tokens of each row (no stop token: `eos_token_id` cleared, so every row runs the whole
`max_new_tokens`), and the smallest gap between the best and the second-best logit over every
step and row (how far a token is from a tie: a gap below ~1e-4 would make the golden fragile).
Read by crates/model/src/model/decode/tests.rs. Deterministic: CPU, f32, eager attention, no
sampling.
"""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import transformers
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "fixtures")
FIXTURES = ["tiny-llama", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2",
            "tiny-gemma3", "tiny-phi3", "tiny-phi4"]
PROMPT_LENS = [5, 2, 4]
MAX_NEW = 8


def tokens(r, n):
    """Row r's prompt: the seeded walk rtune's decoding tests use."""
    return [(i * 37 + 5 + 61 * r) % 200 + 3 for i in range(n)]


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    out = {"transformers": transformers.__version__, "torch": torch.__version__,
           "max_new_tokens": MAX_NEW, "fixtures": {}}
    for name in FIXTURES:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(FIX, name), dtype=torch.float32,
                                                     attn_implementation="eager")
        model.eval()
        prompts = [tokens(r, n) for r, n in enumerate(PROMPT_LENS)]
        width = max(PROMPT_LENS)
        pad = 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                               max_new_tokens=MAX_NEW, min_new_tokens=0, eos_token_id=None,
                               pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
        new = g.sequences[:, width:].tolist()
        gap = min(float((top[:, 0] - top[:, 1]).min())
                  for top in (s.topk(2, dim=-1).values for s in g.logits))
        out["fixtures"][name] = {"prompts": prompts, "tokens": new, "min_gap": gap}
        print(name, new, f"min gap {gap:.3g}")
    path = os.path.join(HERE, "golden_greedy.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
