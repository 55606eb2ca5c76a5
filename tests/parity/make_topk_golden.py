"""torch's CPU `topk` on rows full of ties, and transformers 5.24's routers on tied logits, for
rtune-experts' top-k (crates/experts/src/route/topk.rs, tested in route/tests.rs).

    python tests/parity/make_topk_golden.py --out tests/parity/golden_topk.safetensors

`x.<n>.<k>` [40, n] f32: rows drawn from a few repeated values (1, 2, 3 or 6 levels of 0.25), a
tenth of them with one to three NaN and signed zeros among the zeros; `idx.<n>.<k>` [40, k] i64:
`torch.topk(x, k, dim=-1)`'s indices (largest, sorted). The shapes cover torch's two paths
(`k * 64 <= n`: a partial sort; otherwise nth_element, then a sort of the first k - 1, past its
16-element insertion sort with k 20). `router.logits` [64, 128]: logits of four levels of 0.5,
so many tie; `router.<name>.experts` [64, 8] i64 and `router.<name>.weights` [64, 8] f32: each
router of identity_routers.py (qwen3, qwen3_nonorm, mixtral, gptoss) on them, top-8. Deterministic, byte-identical
reruns (no metadata).
"""
import argparse

import torch
from safetensors.torch import save_file

from identity_routers import identity_routers

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

g = torch.Generator().manual_seed(0)
ROWS = 40
out = {}
for n, k in [(3, 2), (8, 2), (8, 8), (32, 4), (37, 5), (60, 4), (64, 20), (100, 17), (128, 2),
             (128, 8), (129, 2), (300, 4), (1100, 16)]:
    x = torch.empty(ROWS, n)
    for r in range(ROWS):
        levels = [1, 2, 3, 6][r % 4]
        x[r] = torch.randint(0, levels, (n,), generator=g).float() * 0.25
        if r % 10 == 7:
            for _ in range(1 + r % 3):
                x[r, torch.randint(0, n, (1,), generator=g)] = float("nan")
        if r % 10 == 3:
            zeros = (x[r] == 0).nonzero().flatten()
            x[r, zeros[::2]] = -0.0
    _, idx = torch.topk(x, k, dim=-1)
    out[f"x.{n}.{k}"] = x
    out[f"idx.{n}.{k}"] = idx.to(torch.int64)

N, E, K = 64, 128, 8
logits = torch.randint(0, 4, (N, E), generator=g).float() * 0.5
out["router.logits"] = logits
for name, r in identity_routers(E, K).items():
    with torch.no_grad():
        _, scores, idx = r(logits)
    out[f"router.{name}.experts"] = idx.to(torch.int64)
    out[f"router.{name}.weights"] = scores.float()

save_file({k: v.contiguous() for k, v in out.items()}, args.out)
print(f"wrote {args.out}: {len(out)} tensors")
