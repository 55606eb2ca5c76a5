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
gpt-oss (`--only gpt_oss`): a tiny random `GptOssForCausalLM` (2 layers, sliding then full, window
4 over 16 tokens; biases on q/k/v/o, the router and the experts; sinks drawn N(0, 1); 8 experts of
width 32, top-2, top-k of the logits then softmax; `swiglu_limit` 1.0 so the clamp acts at this
scale; YaRN RoPE factor 4 over 64 original positions; `output_router_logits` with
`router_aux_loss_coef` 0.1), saved by transformers in its layout (`mlp.experts.gate_up_proj:
(E, H, 2I)` gate/up interleaved, `mlp.experts.down_proj: (E, I, H)`) under tests/fixtures/tiny-gpt-oss/;
PEFT as above. Beside it, tests/fixtures/tiny-gpt-oss-mxfp4/: the same model with its expert stacks
quantized to MXFP4 as the released checkpoints store them (`*_blocks: (E, out, in/32, 16)` u8, two
E2M1 codes a byte, low nibble first; `*_scales: (E, out, in/32)` u8, e8m0 biased by 127; the
`quantization_config` of the release), by this script's own round-to-nearest quantizer, and
golden_gpt_oss_mxfp4.safetensors: transformers' `convert_moe_packed_tensors` of those blocks in f32
(what its dequantizing load gives).
bf16 (`--only qwen3_moe_bf16,mixtral_bf16,gpt_oss_bf16`): the same three fixtures (not remade) loaded
and computed in bf16 by transformers (its default `grouped_mm` experts), PEFT's LoRA weights in f32 as
it keeps them (`autocast_adapter_dtype`); PEFT folds each expert stack's update into the bf16 stack
(`baddbmm(W, lhs, rhs)` in bf16, factors cast to bf16) before the experts run. The same keys, the
golden named golden_tiny_<family>_bf16.safetensors, `meta.dtype` "bfloat16"; torch's bf16 CPU
kernels are chosen by CPU, so a rerun elsewhere may differ in the last bits (made on the 2-core
AVX-512-BF16 EPYC).
QLoRA (`--only qwen3_moe_nf4`): the Qwen3-MoE fixture loaded by transformers with bitsandbytes
0.50.2's `load_in_4bit` (NF4, compute f32), which quantizes every `nn.Linear` (attention, the dense
layer's MLP) but not the fused 3-D expert parameters nor the router (`nn.Parameter`s, not linears):
they stay f32, and PEFT's `target_parameters` adapts them as above. NF4 dequantized by the format's
definition (make_goldens.py's `nf4_dequantize_by_definition`); golden_tiny_qwen3_moe_nf4.safetensors.
bf16 autocast (`--only qwen3_moe_autocast`): the Qwen3-MoE fixture in f32, every forward (the
golden's, the base logits', the AdamW steps') under `torch.autocast('cpu', dtype=torch.bfloat16)`
and each backward after it, as make_goldens.py's golden_tiny_autocast. What autocast does to this
model (checked with a TorchDispatchMode log of the aten ops): the router's `F.linear` runs in bf16
(bf16 logits, so the routing weights are rounded to bf16 and the load-balancing loss takes a bf16
softmax); transformers' default `grouped_mm` experts are not on autocast's list and cast their
input to the weight's dtype, so the experts compute in f32, and PEFT's fold of the expert LoRA
(`baddbmm`) runs with autocast disabled, in f32. golden_tiny_qwen3_moe_autocast.safetensors,
`meta.autocast_bf16` true; torch's bf16 kernels are chosen by CPU (made on the 2-core
AVX-512-BF16 EPYC).
Deterministic: seeded init, deterministic algorithms, CPU, f32 (bf16 where named), eager attention.
"""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

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
    "gpt_oss": GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
        output_router_logits=True, router_aux_loss_coef=0.1, tie_word_embeddings=False,
        attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64}),
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
            elif n.endswith("mlp.gate.weight") or ".mlp.router." in n:  # wide routers: mixed routing
                p.normal_(0.0, 0.5)
            elif n.endswith("self_attn.sinks"):  # sinks large enough to take a real share
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
    out_dir = os.path.join(FIX, f"tiny-{name.replace('_', '-')}")
    model.save_pretrained(out_dir, safe_serialization=True)
    golden(name, out_dir, torch.float32)
    if name == "gpt_oss":
        mxfp4(model, out_dir)


def quantize_mxfp4(w):
    """`w: (E, in, out)` (transformers' layout) -> the release's `(blocks, scales)` of `(E, out, in)`:
    per 32 inputs one e8m0 scale 2^(s-127) with s = floor(log2(max |w|)) - 2 + 127 (6 = 1.5 * 2^2
    the largest code), each value rounded to the nearest E2M1 code of w / scale."""
    w = w.detach().float().transpose(1, 2).contiguous()  # (E, out, in)
    e, o, i = w.shape
    g = w.reshape(e, o, i // 32, 32)
    amax = g.abs().amax(-1).clamp_min(2.0 ** -100)
    s = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    x = g / torch.exp2(s)[..., None]
    lut = torch.tensor(FP4_VALUES)
    codes = (x[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # (E, out, G, 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (s + 127).to(torch.uint8).contiguous()


def mxfp4(model, dense_dir):
    """The MXFP4 copy of the fixture and transformers' dequantization of it."""
    import shutil
    from safetensors.torch import load_file
    out_dir = os.path.join(FIX, "tiny-gpt-oss-mxfp4")
    os.makedirs(out_dir, exist_ok=True)
    dense = load_file(os.path.join(dense_dir, "model.safetensors"))
    q, want = {}, {}
    for k, v in dense.items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            blocks, scales = quantize_mxfp4(v)
            q[k + "_blocks"], q[k + "_scales"] = blocks, scales
            want[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            q[k] = v
    save_file(q, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dense_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    shutil.copy(os.path.join(dense_dir, "generation_config.json"), out_dir)
    # transformers' own dequantizing load of the copy gives exactly these tensors.
    from transformers import Mxfp4Config
    loaded = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in want.items())
    save_file(want, os.path.join(HERE, "golden_gpt_oss_mxfp4.safetensors"))
    print("mxfp4:", sorted(q)[:4], "...")


def golden(name, model_dir, dtype, nf4=False, autocast=False):
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    kwargs = {}
    if nf4:
        from make_goldens import nf4_dequantize_by_definition
        from transformers import BitsAndBytesConfig
        nf4_dequantize_by_definition()
        kwargs = dict(device_map="cpu", quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
            bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.uint8))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager", **kwargs)
    if nf4:  # bitsandbytes leaves the 3-D expert stacks (and the router) unquantized
        experts = [n for n, p in model.named_parameters() if ".mlp.experts." in n]
        assert experts and all(model.get_parameter(n).dtype == torch.float32 for n in experts)
        import bitsandbytes as bnb
        for m in model.modules():  # no AVX-512 repacking for the no-grad forward: rows of 96 fail it
            if isinstance(m, bnb.nn.Linear4bit):
                m.support_avx512bf16_for_cpu = False
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
    assert all(p.dtype == torch.float32 for _, p in params), "PEFT keeps LoRA weights in f32"
    tensors = {"init." + peft_key(n): p.detach().clone() for n, p in params}
    ids = torch.randint(3, cfg_vocab(model), (B, T), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = 1
    labels = ids.clone()
    labels[:, :4] = -100
    def amp():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)

    with amp():
        out = model(input_ids=ids, labels=labels, output_hidden_states=True)
    out.loss.backward()
    tensors.update(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                   logits=out.logits.detach().float(), loss=out.loss.detach().float().reshape(1),
                   aux_loss=out.aux_loss.detach().float().reshape(1))
    for i, h in enumerate(out.hidden_states):
        tensors[f"hidden_states.{i}"] = h.detach().float()
    for n, p in params:
        tensors["grad." + peft_key(n)] = p.grad.detach().float().clone()
    with torch.no_grad(), model.disable_adapter(), amp():
        tensors["base_logits"] = model(input_ids=ids).logits.float()
    opt = torch.optim.AdamW([p for _, p in params], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with amp():
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
            "model": name, "dtype": str(dtype).replace("torch.", ""), "quant": "nf4" if nf4 else None, "versions": {"torch": torch.__version__,
                                                            "transformers": __import__("transformers").__version__,
                                                            "peft": __import__("peft").__version__}}
    if autocast:
        meta["autocast_bf16"] = True
    path = os.path.join(HERE, f"golden_tiny_{name}.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"config": json.dumps(meta)})
    print(name, "loss", out.loss.item(), "aux", out.aux_loss.item(), "adamw", losses)
    print("\n".join(saved))


def cfg_vocab(model):
    return model.config.vocab_size


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated names (qwen3_moe, mixtral, gpt_oss, "
                    "qwen3_moe_bf16, mixtral_bf16, gpt_oss_bf16, qwen3_moe_nf4, qwen3_moe_autocast, "
                    "mixtral_autocast, gpt_oss_autocast)")
    only = set(filter(None, ap.parse_args().only.split(",")))
    for name, cfg in MODELS.items():
        if not only or name in only:
            make(name, cfg)
    # bf16 compute on the committed fixtures (f32 on disk, cast at load).
    for name in MODELS:
        if not only or f"{name}_bf16" in only:
            golden(f"{name}_bf16", os.path.join(FIX, f"tiny-{name.replace('_', '-')}"), torch.bfloat16)
    # QLoRA: bitsandbytes NF4 on the linears, the experts as stored.
    if not only or "qwen3_moe_nf4" in only:
        golden("qwen3_moe_nf4", os.path.join(FIX, "tiny-qwen3-moe"), torch.float32, nf4=True)
    # bf16 autocast on the f32 fixtures.
    for name in MODELS:
        if not only or f"{name}_autocast" in only:
            golden(f"{name}_autocast", os.path.join(FIX, f"tiny-{name.replace('_', '-')}"), torch.float32,
                   autocast=True)
