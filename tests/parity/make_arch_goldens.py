#!/usr/bin/env python3
"""Goldens for the architectures the shared fixtures do not cover: Qwen2 (q/k/v bias, tied
embeddings, sliding window on some layers) and Mistral (sliding window on every layer, head_dim set
explicitly and != hidden/heads). Written for rtune; run with the reference venv (torch, transformers,
peft):

    python tests/parity/make_arch_goldens.py

`--only phi3,phi4` makes the Phi-3 fixtures (fused qkv_proj / gate_up_proj, adapted under PEFT's fused
names; Phi-4-mini's partial rotary and LongRoPE).

Writes tests/fixtures/tiny-{qwen2,mistral}/ (config.json in transformers v5 layout + model.safetensors)
and tests/parity/golden_tiny_{qwen2,mistral}.safetensors, plus golden_tiny_llama_bf16.safetensors (the
plain tiny Llama computed in bf16, LoRA weights in f32 as PEFT keeps them), with the same keys and metadata as the other
goldens (input_ids, labels, logits, base_logits, loss, hidden_states.*, init.*, grad.*, adamw.*).
Deterministic: seeded init, deterministic algorithms, CPU, f32, eager attention.
"""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, MistralConfig, Olmo2Config,
                          Phi3Config, Qwen2Config, Qwen3Config)

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "fixtures")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Phi-3 fuses q/k/v and gate/up: PEFT's targets are the fused modules (one adapter each).
FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
R, ALPHA, B, T, STEPS, LR = 4, 8.0, 2, 16, 3, 1e-3

common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, max_position_embeddings=256)
MODELS = {
    # layer 0 full attention, layer 1 a window of 6 (max_window_layers = 1)
    "qwen2": Qwen2Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                         tie_word_embeddings=True, rope_theta=10000.0),
    # every layer a window of 5; head_dim 8 while hidden/heads = 16
    "mistral": MistralConfig(**common, sliding_window=5, head_dim=8, rope_theta=1e6),
    # Qwen3: per-head q/k RMSNorm, no bias, head_dim 24 != hidden/heads = 16, tied, a window of 6
    # on layer 1 only; every norm weight jittered around 1 (`JITTER_NORMS`)
    "qwen3": Qwen3Config(**common, head_dim=24, use_sliding_window=True, sliding_window=6,
                         max_window_layers=1, tie_word_embeddings=True, rope_theta=10000.0),
    # Gemma 2: (1 + w) norms, four a layer, GeGLU (tanh), embeddings × √hidden, attention scaled by
    # query_pre_attn_scalar (24, not head_dim 16), attention logits soft-capped at 2 and final
    # logits at 3 (small enough to act), a window of 6 on layer 0 (the even layers)
    "gemma2": Gemma2Config(**{**common, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1},
                           head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                           hidden_activation="gelu_pytorch_tanh", rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 10000.0}),
    # Gemma 3 (text): Gemma 2's layer with q/k norms and no soft-capping; layer 0 local (window 6,
    # RoPE base 10k), layer 1 global (RoPE base 1M, linear scaling 4); head_dim 24
    "gemma3": Gemma3TextConfig(**{**common, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1},
                               head_dim=24, query_pre_attn_scalar=20, sliding_window=6,
                               layer_types=["sliding_attention", "full_attention"],
                               hidden_activation="gelu_pytorch_tanh",
                               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                   "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "default",
                                                                      "rope_theta": 10000.0}}),
    # Phi-3: fused qkv_proj and gate_up_proj, untied, a window of 6 on every layer, full rotary
    "phi3": Phi3Config(**common, sliding_window=6, rope_parameters={"rope_type": "default",
                                                                    "rope_theta": 10000.0}),
    # Phi-4-mini's shape: RoPE on the first 0.75 of each head (12 of 16 dims), LongRoPE with
    # original_max_position_embeddings 8 < T = 16 (the long factors; `short_logits` holds the first
    # 8 positions run alone, the short factors), attention factor √(1 + ln 32 / ln 8) from
    # max_position_embeddings / original = 256 / 8, tied embeddings
    "phi4": Phi3Config(**common, tie_word_embeddings=True, original_max_position_embeddings=8,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.75,
                                        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}),
    # OLMo 2: norms after attention and after the MLP only (no input or pre-feed-forward norm),
    # q/k RMSNorm over the whole projection width (q: 64, k: 32) before RoPE, untied; every norm
    # weight jittered around 1, so a per-head q/k norm or a norm in the wrong place changes every
    # output
    "olmo2": Olmo2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
# Families whose adapters target the fused modules.
FUSED = {"phi3", "phi4"}
# Families with LongRoPE: the golden also holds `short_logits` (the first SHORT_T tokens alone).
LONGROPE = {"phi4"}
SHORT_T = 8
# Families whose norm weights are drawn as 1 + N(0, 0.1) instead of left at 1, so a norm applied
# with the wrong weight (or the wrong formula: w vs 1 + w) changes every output.
JITTER_NORMS = {"qwen3", "phi3", "phi4", "olmo2"}
# Families whose norms multiply by (1 + w) (stored w = 0 is the identity): drawn as N(0, 0.1).
PLUS_ONE_NORMS = {"gemma2", "gemma3"}


def peft_key(name):
    return name.replace(".default.", ".")


def make(name, cfg):
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger than the default 0.02 so attention is not uniform
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0.0, 0.1)
            elif name in JITTER_NORMS:
                p.normal_(1.0, 0.1)
            elif name in PLUS_ONE_NORMS:
                p.normal_(0.0, 0.1)
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
    out_dir = os.path.join(FIX, f"tiny-{name}")
    model.save_pretrained(out_dir, safe_serialization=True)
    golden(name, out_dir, torch.float32, cfg.vocab_size)


def golden(name, model_dir, dtype, vocab):
    """LoRA on every linear layer of the model in `model_dir`, computed in `dtype` (LoRA weights f32,
    as PEFT keeps them); writes golden_tiny_<name>.safetensors."""
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    targets = FUSED_TARGETS if name.removesuffix("_bf16") in FUSED else TARGETS
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0,
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
    ids = torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = 1
    labels = ids.clone()
    labels[:, :4] = -100
    out = model(input_ids=ids, labels=labels, output_hidden_states=True)
    out.loss.backward()
    tensors.update(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                   logits=out.logits.detach().float(), loss=out.loss.detach().float().reshape(1))
    for i, h in enumerate(out.hidden_states):
        tensors[f"hidden_states.{i}"] = h.detach().float()
    for n, p in params:
        tensors["grad." + peft_key(n)] = p.grad.detach().float().clone()
    with torch.no_grad(), model.disable_adapter():
        tensors["base_logits"] = model(input_ids=ids).logits.float()
    if name in LONGROPE:
        with torch.no_grad():  # max position + 1 = SHORT_T <= original: the short factors
            tensors["short_logits"] = model(input_ids=ids[:, :SHORT_T]).logits.float()
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
    meta = {"r": R, "lora_alpha": ALPHA, "use_rslora": False, "scaling": ALPHA / R, "target_modules": targets,
            "n_lora_modules": len(params) // 2, "adamw": {"lr": LR, "weight_decay": 0.0, "steps": STEPS},
            "model": name, "dtype": str(dtype).replace("torch.", ""), "versions": {"torch": torch.__version__,
                                        "transformers": __import__("transformers").__version__,
                                        "peft": __import__("peft").__version__}}
    path = os.path.join(HERE, f"golden_tiny_{name}.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"config": json.dumps(meta)})
    print(name, "loss", out.loss.item(), "adamw", losses)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated names (qwen2,mistral,qwen3,gemma2,gemma3,phi3,phi4,olmo2,"
                    "llama_bf16,gemma2_bf16,gemma3_bf16,qwen3_bf16,phi3_bf16,phi4_bf16,olmo2_bf16,qwen2_bf16)")
    only = set(filter(None, ap.parse_args().only.split(",")))
    for name, cfg in MODELS.items():
        if not only or name in only:
            make(name, cfg)
    # bf16 compute on the plain tiny Llama (f32 weights on disk, cast at load)
    if not only or "llama_bf16" in only:
        golden("llama_bf16", os.path.join(FIX, "tiny-llama"), torch.bfloat16, 512)
    # bf16 compute on the Gemma fixtures: (1 + w) norms in f32 rounded once, GeGLU, soft caps and
    # the embedding scale on bf16 activations; Qwen3's q/k norms; Phi-3's fused projections and
    # Phi-4's partial rotary with LongRoPE; OLMo 2's norms (f32 products, one rounding) and
    # whole-width q/k norms; Qwen2's q/k/v biases (F.linear: the bias inside the GEMM, one rounding)
    for fam in ("gemma2", "gemma3", "qwen3", "phi3", "phi4", "olmo2", "qwen2"):
        if not only or f"{fam}_bf16" in only:
            golden(f"{fam}_bf16", os.path.join(FIX, f"tiny-{fam}"), torch.bfloat16, 256)
