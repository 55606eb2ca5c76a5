"""transformers 5.24's sampling logits processors on seeded logits, for rtune's `warp` tests
(crates/train/src/warp.rs): the repetition penalty, temperature, top-k, top-p and min-p in the order
`generate` applies them, for a grid of settings.

    python tests/parity/make_warpers_golden.py --out tests/parity/golden_warpers.safetensors

Tensors: `logits` [8, 96] f32 (seeded normal × 3), `seen` [8, 12] i64 (the tokens each row holds,
repeats included), `settings` [cases × 5] f32 (temperature, top_k, top_p, min_p (0 = off),
repetition_penalty), `out.<case>` [8, 96] f32: the processed logits (-inf where removed).
Deterministic, byte-identical reruns (no metadata).
"""
import argparse

import torch
from safetensors.torch import save_file
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

g = torch.Generator().manual_seed(0)
logits = torch.randn(8, 96, generator=g) * 3
seen = torch.randint(0, 96, (8, 12), generator=g)
# (temperature, top_k, top_p, min_p, repetition_penalty)
grid = [
    (1.0, 0, 1.0, 0.0, 1.0),
    (0.7, 0, 1.0, 0.0, 1.0),
    (1.0, 5, 1.0, 0.0, 1.0),
    (1.0, 1, 1.0, 0.0, 1.0),
    (1.0, 0, 0.9, 0.0, 1.0),
    (1.3, 0, 0.5, 0.0, 1.0),
    (1.0, 0, 1.0, 0.1, 1.0),
    (0.8, 20, 0.95, 0.05, 1.0),
    (1.0, 0, 1.0, 0.0, 1.2),
    (0.9, 10, 0.8, 0.02, 1.1),
]


def processors(t, k, tp, mp, rp):
    # The order and conditions of GenerationMixin._get_logits_processor (transformers 5.24,
    # generation/utils.py): the repetition penalty among the processors, then the warpers.
    out = LogitsProcessorList()
    if rp != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(penalty=rp))
    if t != 1.0:
        out.append(TemperatureLogitsWarper(t))
    if k != 0:
        out.append(TopKLogitsWarper(top_k=k, min_tokens_to_keep=1))
    if tp < 1.0:
        out.append(TopPLogitsWarper(top_p=tp, min_tokens_to_keep=1))
    if mp > 0.0:
        out.append(MinPLogitsWarper(min_p=mp, min_tokens_to_keep=1))
    return out


tensors = {"logits": logits, "seen": seen,
           "settings": torch.tensor(grid, dtype=torch.float32).reshape(-1)}
for c, s in enumerate(grid):
    tensors[f"out.{c}"] = processors(*s)(seen, logits.clone())
save_file({k: v.contiguous() for k, v in tensors.items()}, args.out)
