"""transformers 5.24's three families' router classes with an identity weight (hidden size =
experts) and, where they have one, a zero bias, so that a router's logits are its input: the
routers of make_route_golden.py and make_topk_golden.py."""
from types import SimpleNamespace

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter


def identity_routers(e, k):
    """`{name: router}` over `e` experts, top-`k`: qwen3 (norm_topk_prob true), qwen3_nonorm,
    mixtral, gptoss."""
    def cfg(**kw):
        return SimpleNamespace(hidden_size=e, num_experts_per_tok=k, num_experts=e,
                               num_local_experts=e, **kw)

    routers = {
        "qwen3": Qwen3MoeTopKRouter(cfg(norm_topk_prob=True)),
        "qwen3_nonorm": Qwen3MoeTopKRouter(cfg(norm_topk_prob=False)),
        "mixtral": MixtralTopKRouter(cfg()),
        "gptoss": GptOssTopKRouter(cfg()),
    }
    for r in routers.values():
        with torch.no_grad():
            r.weight.copy_(torch.eye(e))
            if hasattr(r, "bias"):
                r.bias.zero_()
    return routers
