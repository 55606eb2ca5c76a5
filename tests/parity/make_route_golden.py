"""Mixture-of-experts routing by transformers 5.24's own router classes and its load-balancing loss,
for rtune-experts' `route` tests (crates/experts/src/route/tests.rs).

    python tests/parity/make_route_golden.py --out tests/parity/golden_route.safetensors

Each router gets an identity weight (hidden size = experts), so its logits are the seeded inputs
`logits` [6, 8]; `<router>.experts` [6, 2] and `<router>.weights` [6, 2] are its outputs, and
`<router>.dlogits` [6, 8] the gradient of sum(weights * dweights) (`dweights` [6, 2]) with respect
to the logits. Routers: qwen3 (norm_topk_prob true), qwen3_nonorm, mixtral, gptoss (zero bias).
`aux.loss` and `aux.d<i>` come from `load_balancing_loss_func` over three layers' logits
`aux.l<i>` [6, 8] (batch 2 × seq 3, top-2, attention mask `aux.mask` [2, 3] with one pad).
`bf16.*`: the same routers and loss in bf16, where torch rounds the logits' two gradients apart
(see the section below). Deterministic, byte-identical reruns (no metadata).
"""
import argparse

import torch
from safetensors.torch import save_file
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from identity_routers import identity_routers

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

N, E, K = 6, 8, 2
g = torch.Generator().manual_seed(0)
logits = torch.randn(N, E, generator=g) * 2
dweights = torch.randn(N, K, generator=g)
out = {"logits": logits, "dweights": dweights}

routers = identity_routers(E, K)
for name, r in routers.items():
    x = logits.clone().requires_grad_(True)
    _, scores, idx = r(x)
    (scores * dweights).sum().backward()
    out[f"{name}.experts"] = idx.to(torch.int64)
    out[f"{name}.weights"] = scores.detach().float()
    out[f"{name}.dlogits"] = x.grad

layers = [(torch.randn(N, E, generator=g) * 2).requires_grad_(True) for _ in range(3)]
mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
loss = load_balancing_loss_func(tuple(layers), num_experts=E, top_k=K, attention_mask=mask)
loss.backward()
out["aux.loss"] = loss.detach().reshape(1)
out["aux.mask"] = mask.to(torch.float32)
for i, l in enumerate(layers):
    out[f"aux.l{i}"] = l.detach()
    out[f"aux.d{i}"] = l.grad

# bf16: torch's router-logit gradient in a bf16 model, where the logits get two gradients, each
# rounded to bf16 by its own path and summed in bf16: the routing path's (through the family's
# router, d scores = `bf16.dw<i>` [64, 2]) and the load-balancing loss's (coefficient 0.1, from
# the bf16 softmax of the logits). Two layers' bf16 logits `bf16.l<i>` [64, 8] (identity routers
# in bf16); `bf16.<router>.<all|masked>.d<i>` the logits' gradient without and with the attention
# mask `bf16.mask` [2, 32] (five pads); `bf16.<router>.route.d<i>` the routing path's alone;
# `bf16.aux.<all|masked>` the loss before its coefficient. A separate generator: the f32 keys
# above are unchanged.
NB, COEF = 64, 0.1
gb = torch.Generator().manual_seed(1)
blogits = [(torch.randn(NB, E, generator=gb) * 2).bfloat16() for _ in range(2)]
bdw = [torch.randn(NB, K, generator=gb).bfloat16().float() for _ in range(2)]
bmask = torch.ones(2, NB // 2)
bmask[1, -5:] = 0
out["bf16.mask"] = bmask
for i in range(2):
    out[f"bf16.l{i}"] = blogits[i].float()
    out[f"bf16.dw{i}"] = bdw[i]
for name, r in routers.items():
    r = r.bfloat16()
    for masked, am in [("all", None), ("masked", bmask)]:
        xs = [x.clone().requires_grad_(True) for x in blogits]
        outs = [r(x) for x in xs]
        routed = sum((o[1].float() * dw).sum() for o, dw in zip(outs, bdw))
        aux = load_balancing_loss_func(tuple(o[0] for o in outs), num_experts=E, top_k=K, attention_mask=am)
        (routed + COEF * aux).backward()
        out[f"bf16.aux.{masked}"] = aux.detach().float().reshape(1)
        for i, x in enumerate(xs):
            out[f"bf16.{name}.{masked}.d{i}"] = x.grad.float()
    for i, x in enumerate(blogits):
        x = x.clone().requires_grad_(True)
        (r(x)[1].float() * bdw[i]).sum().backward()
        out[f"bf16.{name}.route.d{i}"] = x.grad.float()
save_file({k: v.contiguous() for k, v in out.items()}, args.out)
