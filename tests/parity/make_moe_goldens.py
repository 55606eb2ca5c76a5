#!/usr/bin/env python3
"""Goldens for the mixture-of-experts families (issue 45). Written for rtune; run with the
reference venv (torch, transformers 5, peft 0.21):

    python tests/parity/make_moe_goldens.py

Qwen3-MoE (`--only qwen3_moe`): a tiny random `Qwen3MoeForCausalLM` (3 layers: 0 and 2 sparse, 1
dense through `mlp_only_layers`; 8 experts, top-2, `norm_topk_prob`; routers drawn wide so tokens
spread over the experts; `output_router_logits` on with `router_aux_loss_coef` 0.1 so the
load-balancing term moves the loss and the gradients), saved by transformers in its fused layout
(`mlp.experts.gate_up_proj: (E, 2I, H)`, `mlp.experts.down_proj: (E, H, I)`) under
tests/fixtures/tiny-qwen3-moe/; and PEFT with LoRA on q/k/v/o (`target_modules`) and on the experts
(`target_parameters`, one `ParamWrapper` per 3-D parameter, rank r per expert). The golden has the
keys of make_arch_goldens.py (input_ids, labels, logits, base_logits, loss, hidden_states.*,
init.*, grad.*, adamw.*) plus `aux_loss` (before the coefficient); `loss` and `adamw.loss` include
the aux term as transformers adds it. `meta.peft_keys` lists the adapter's saved key names
(`get_peft_model_state_dict`), `meta.target_parameters` the parameters.
Mixtral (`--only mixtral`): a tiny random `MixtralForCausalLM` (2 layers, every MLP 8 experts of
width 32, top-2, softmax → top-k → renormalised; no router jitter; `output_router_logits` with
`router_aux_loss_coef` 0.1), which transformers 5 saves in Mixtral's released per-expert layout
(`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.N.w1/w3/w2.weight`) under
tests/fixtures/tiny-mixtral/; PEFT as above (the parameters keep transformers 5's module names,
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj`).
Deterministic: seeded init, deterministic algorithms, CPU, f32, eager attention.
"""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "fixtures")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
R, ALPHA, B, T, STEPS, LR = 4, 8.0, 2, 16, 3, 1e-3

MODELS = {
    "qwen3_moe": Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], output_router_logits=True,
        router_aux_loss_coef=0.1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mixtral": MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256,
        num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None,
        output_router_logits=True, router_aux_loss_coef=0.1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def peft_key(name):
    return name.replace(".default.", ".")


def make(name, cfg):
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # jittered around 1: a norm in the wrong place changes every output
                p.normal_(1.0, 0.1)
            elif n.endswith("mlp.gate.weight"):  # wide routers: mixed, decisive routing
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.1)
    out_dir = os.path.join(FIX, f"tiny-{name.replace('_', '-')}")
    model.save_pretrained(out_dir, safe_serialization=True)
    golden(name, out_dir)


def golden(name, model_dir):
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS,
                                             target_parameters=PARAMS, lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, mod in model.named_modules():
            if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
                a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
                a.copy_((torch.rand(a.shape, generator=g) * 2 - 1) / a.shape[1] ** 0.5)
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    tensors = {"init." + peft_key(n): p.detach().clone() for n, p in params}
    ids = torch.randint(3, cfg_vocab(model), (B, T), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = 1
    labels = ids.clone()
    labels[:, :4] = -100
    out = model(input_ids=ids, labels=labels, output_hidden_states=True)
    out.loss.backward()
    tensors.update(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                   logits=out.logits.detach().float(), loss=out.loss.detach().float().reshape(1),
                   aux_loss=out.aux_loss.detach().float().reshape(1))
    for i, h in enumerate(out.hidden_states):
        tensors[f"hidden_states.{i}"] = h.detach().float()
    for n, p in params:
        tensors["grad." + peft_key(n)] = p.grad.detach().float().clone()
    with torch.no_grad(), model.disable_adapter():
        tensors["base_logits"] = model(input_ids=ids).logits.float()
    opt = torch.optim.AdamW([p for _, p in params], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    tensors["adamw.loss"] = torch.tensor(losses)
    for n, p in params:
        tensors["adamw." + peft_key(n)] = p.detach().clone()
    saved = sorted(get_peft_model_state_dict(model).keys())
    meta = {"r": R, "lora_alpha": ALPHA, "use_rslora": False, "scaling": ALPHA / R, "target_modules": TARGETS,
            "target_parameters": PARAMS, "peft_keys": saved,
            "n_lora_modules": len(params) // 2, "adamw": {"lr": LR, "weight_decay": 0.0, "steps": STEPS},
            "model": name, "dtype": "float32", "versions": {"torch": torch.__version__,
                                                            "transformers": __import__("transformers").__version__,
                                                            "peft": __import__("peft").__version__}}
    path = os.path.join(HERE, f"golden_tiny_{name}.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"config": json.dumps(meta)})
    print(name, "loss", out.loss.item(), "aux", out.aux_loss.item(), "adamw", losses)
    print("\n".join(saved))


def cfg_vocab(model):
    return model.config.vocab_size


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated names (qwen3_moe, mixtral)")
    only = set(filter(None, ap.parse_args().only.split(",")))
    for name, cfg in MODELS.items():
        if not only or name in only:
            make(name, cfg)
