#!/usr/bin/env python3
"""rtune's own generator for the Llama parity goldens and the two tiny Llama fixture models.

Run with the reference venv (torch 2.15.0, transformers 5.24.0, peft 0.21.2, bitsandbytes 0.50.2,
tokenizers 0.23.3, safetensors 0.8.0; CPU only):

    python tests/parity/make_goldens.py --out /tmp/goldens            # everything, ~40 s on 2 cores
    python tests/parity/make_goldens.py --out /tmp/goldens --check    # ... and compare with the repo

It writes into OUT:

    tiny/                  -> tests/fixtures/tiny-llama/   (hidden 64, 2 layers, 4/2 heads, f32, untied)
    tiny_l3/               -> tests/fixtures/tiny-llama3/  (hidden 128, 3 layers, 4/1 heads, llama3 rope,
                                                            tied, bf16, 2 shards)
    golden_tiny.safetensors, adapter_tiny_init/            (tiny, r 8, alpha 16, B 2, T 16)
    golden_tiny_l3.safetensors                             (tiny_l3, r 4, alpha 8, B 3, T 40)
    golden_tiny_l3_rslora.safetensors                      (the same with rsLoRA)
    golden_tiny_qlora_nf4.safetensors                      (tiny, base linears in bnb NF4)
    golden_tiny_qlora_nf4dq.safetensors                    (the same with double quant)
    golden_tiny_dora.safetensors                           (tiny, DoRA, all-linear)
    golden_tiny_l3_dora_rslora_wd.safetensors              (tiny_l3, DoRA subset, rsLoRA, wd 0.1)
    golden_tiny_qdora_nf4dq.safetensors                    (tiny, QDoRA over NF4 double quant)

The files committed under tests/ were first made by the reference scripts in shared/reference/
(make_tiny.py, peft_reference.py; not part of rtune). This script is an independent rewrite that
produces the same bytes: same random draws in the same order, same tensor names and dtypes, same
metadata strings. The model directories are called `tiny` and `tiny_l3` here (not tiny-llama) because
the goldens record that name twice in their metadata (`model_dir` and `model_config._name_or_path`).

Deterministic: seeded generators, torch.use_deterministic_algorithms, CPU, f32 compute, eager attention,
torch pinned to its AVX2 kernels, NF4 dequantized by definition (see nf4_dequantize_by_definition).
`adapter_tiny_init/adapter_config.json` is PEFT's own file; PEFT writes target_modules from a Python set,
so its order depends on PYTHONHASHSEED (the weights file does not).
"""
import argparse
import filecmp
import hashlib
import json
import math
import os
import random
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The committed goldens were computed on an AVX2 CPU. torch picks its vectorized kernels by CPU and
# the AVX-512 ones round differently (up to 1.6e-5 in the f32 goldens, measured), so pin torch to its
# AVX2 kernels (before torch loads). With this the files are byte-identical on an AVX-512 machine too.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_TESTS = os.path.dirname(HERE)
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# ---------------------------------------------------------------------------------------------------
# 1. Tiny Llama checkpoints
# ---------------------------------------------------------------------------------------------------

# Text the byte-level BPE tokenizer is trained on. It is data: changing one character changes
# tokenizer.json. Three parts: 16 lines of the Zen of Python, a code snippet, and random sentences
# drawn from WORDS.
ZEN_LINES = [
    "Beautiful is better than ugly.",
    "Explicit is better than implicit.",
    "Simple is better than complex.",
    "Complex is better than complicated.",
    "Flat is better than nested.",
    "Sparse is better than dense.",
    "Readability counts.",
    "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.",
    "Errors should never pass silently.",
    "Unless explicitly silenced.",
    "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Now is better than never.",
    "If the implementation is easy to explain, it may be a good idea.",
    "Namespaces are one honking great idea -- let's do more of those!",
]
CODE_LINES = [
    "def forward(self, x):",
    "    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))",
    "",
    "fn main() -> Result<(), Box<dyn std::error::Error>> {",
    "    let x = Tensor::zeros((4, 512), DType::F32, &device)?;",
    '    println!("{:?}", x.shape());',
    "    Ok(())",
    "}",
]
WORDS = """
the of and to in is that for it as with was on be by this are or at from his but have an they which one
you were her all she there would their we him been has when who will more no if out so said what up its
about into than them can only other new some could time these two may then do first any my now such like
our over man me even most made after also did many before must through back years where much your way
well down should because each just those people how too little state good very make world still own see
men work long get here between both life being under never day same another know while last might us
great old year off come since against go came right used take three model train token weight tensor
gradient adapter layer attention rank alpha learning rate batch sequence loss optimizer step checkpoint
rust python candle llama user assistant system hello thanks please question answer
""".split()
ENDINGS = [".", ".", "?", "!", ",", ":"]

CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def corpus(seed, n_random=4000):
    """The training lines, from Python's `random` (the same on every Python 3)."""
    rng = random.Random(seed)
    lines = ZEN_LINES * 20 + CODE_LINES * 20
    for role in ["system", "user", "assistant"]:
        lines += ["<|%s|>" % role] * 50
    for _ in range(n_random):
        # draw order: length, the words, the ending, then the optional number
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        line = " ".join(words)
        line = line[:1].upper() + line[1:] + rng.choice(ENDINGS)
        if rng.random() < 0.2:
            line += " " + str(rng.randint(0, 10000))
        lines.append(line)
    rng.shuffle(lines)
    return lines


def train_tokenizer(vocab, seed):
    """Byte-level BPE (GPT-2 style, no prefix space), <s> prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(seed), trainer=trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", bos)])
    return tok


def write_json(path, obj, sort_keys=False):
    with open(path, "w") as f:  # no trailing newline, as json.dump writes it
        json.dump(obj, f, indent=2, sort_keys=sort_keys)


def make_llama(out, *, seed, hidden, layers, heads, kv_heads, inter, vocab, theta, max_pos, eps,
               std, dtype, tied, shards, llama3_rope=None):
    """A random Llama checkpoint directory (config.json in the transformers v4 layout)."""
    os.makedirs(out, exist_ok=True)
    head_dim = hidden // heads

    tok = train_tokenizer(min(vocab, 512), seed)
    tok.save(os.path.join(out, "tokenizer.json"))
    pad, bos, eos = (tok.token_to_id(t) for t in SPECIAL)
    write_json(os.path.join(out, "tokenizer_config.json"), {
        "added_tokens_decoder": {str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True} for t in SPECIAL},
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_pos, "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE})
    write_json(os.path.join(out, "special_tokens_map.json"),
               {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})

    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    write_json(os.path.join(out, "config.json"), {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "hidden_act": "silu",
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": max_pos, "rms_norm_eps": eps,
        "initializer_range": std, "pretraining_tp": 1, "use_cache": True,
        "tie_word_embeddings": tied, "rope_theta": theta, "rope_scaling": llama3_rope,
        "torch_dtype": dtype_name, "transformers_version": "make_tiny.py",
    }, sort_keys=True)
    write_json(os.path.join(out, "generation_config.json"), {
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False,
        "max_new_tokens": 32})

    # Weights: one torch generator, drawn in checkpoint order (embeddings; per layer input norm,
    # q, k, v, o, post-attention norm, gate, up, down; final norm; lm_head unless tied), all in f32,
    # cast to `dtype` at the end. Linear = N(0,1)*std as [out, in]; RMSNorm = 1 + 0.1*N(0,1).
    g = torch.Generator().manual_seed(seed)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    shapes = [("model.embed_tokens.weight", (vocab, hidden), "linear")]
    for i in range(layers):
        p = "model.layers.%d." % i
        shapes += [(p + "input_layernorm.weight", (hidden,), "norm"),
                   (p + "self_attn.q_proj.weight", (q_dim, hidden), "linear"),
                   (p + "self_attn.k_proj.weight", (kv_dim, hidden), "linear"),
                   (p + "self_attn.v_proj.weight", (kv_dim, hidden), "linear"),
                   (p + "self_attn.o_proj.weight", (hidden, q_dim), "linear"),
                   (p + "post_attention_layernorm.weight", (hidden,), "norm"),
                   (p + "mlp.gate_proj.weight", (inter, hidden), "linear"),
                   (p + "mlp.up_proj.weight", (inter, hidden), "linear"),
                   (p + "mlp.down_proj.weight", (hidden, inter), "linear")]
    shapes.append(("model.norm.weight", (hidden,), "norm"))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, hidden), "linear"))
    weights = {}
    for name, shape, kind in shapes:
        x = torch.randn(*shape, generator=g)
        weights[name] = (x * std if kind == "linear" else 1.0 + 0.1 * x).to(dtype).contiguous()

    # Shards: consecutive runs of ceil(n/shards) tensors in checkpoint order, plus the index.
    if shards == 1:
        save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = "model-%05d-of-%05d.safetensors" % (s + 1, shards)
        part = {n: weights[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(out, fname), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    write_json(os.path.join(out, "model.safetensors.index.json"),
               {"metadata": {"total_size": total}, "weight_map": weight_map})


def make_models(out):
    # tests/fixtures/tiny-llama
    make_llama(os.path.join(out, "tiny"), seed=0, hidden=64, layers=2, heads=4, kv_heads=2, inter=160,
               vocab=512, theta=10000.0, max_pos=2048, eps=1e-5, std=0.02, dtype=torch.float32,
               tied=False, shards=1)
    # tests/fixtures/tiny-llama3
    make_llama(os.path.join(out, "tiny_l3"), seed=7, hidden=128, layers=3, heads=4, kv_heads=1,
               inter=352, vocab=512, theta=500000.0, max_pos=4096, eps=1e-5, std=0.08,
               dtype=torch.bfloat16, tied=True, shards=2,
               llama3_rope={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 512, "rope_type": "llama3"})


# ---------------------------------------------------------------------------------------------------
# 2. Goldens: transformers + PEFT LoRA, one forward/backward and 3 AdamW steps on a fixed batch
# ---------------------------------------------------------------------------------------------------

# Recorded in every golden's metadata; the Rust tests read some of these strings' facts.
LOSS_NOTE = "HF ForCausalLMLoss: logits[:, :-1] vs labels[:, 1:], cross_entropy mean over labels!=-100, f32"
FORWARD_NOTE = "y = base(x) + scaling * (x @ A^T) @ B^T"
ADAMW_NOTE = ("torch.optim.AdamW (decoupled wd; p -= lr*wd*p; m,v EMA; "
              "p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps))")
QLORA_NOTE = ("base Linear weights (not lm_head/embeddings/norms) NF4-quantized by bitsandbytes, blocksize 64, "
              "row-major flatten of [out,in]; forward = x @ dequant(W)^T in compute dtype + LoRA")

DORA_NOTE = ("DoRA (peft/tuners/lora/dora.py): n = ||W + s*B@A||_row detached, k = m/n, "
             "y = base(x) + (k-1)*(x @ W^T) + k*s*(x @ A^T) @ B^T")

SEED = 1234          # batch tokens
LORA_SEED = 1235     # LoRA A/B draws
B_STD = 0.05         # B ~ N(0,1)*0.05, non-zero so that dL/dA != 0
MASK_PREFIX = 4      # labels[:, :4] = -100
STEPS, LR = 3, 1e-3


def adapter_key(param_name):
    # 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'
    #  -> 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' (PEFT's saved name)
    # DoRA: '....q_proj.lora_magnitude_vector.default.weight' -> '....q_proj.lora_magnitude_vector'
    key = param_name.replace(".default.", ".")
    return key[:-len(".weight")] if key.endswith(".lora_magnitude_vector.weight") else key


def nf4_dequantize_by_definition():
    """Make bitsandbytes dequantize NF4 on the CPU by the format's definition.

    bitsandbytes 0.50.2's native CPU kernel gives wrong values on an AVX-512 CPU (AMD EPYC, measured)
    for a weight whose row length is not a multiple of the block size (down_proj, [64, 160]: up to 0.03
    off), while on the AVX2 machine that made the committed goldens it gave the definition's values.
    The definition: the weight flattened row-major in blocks of 64; element 2i of the packed stream is
    the high nibble of byte i, element 2i+1 the low nibble; value = quant_map[nibble] * absmax[block],
    in f32, then cast. (Double quant dequantizes absmax first, in bitsandbytes' own code.)
    """
    import bitsandbytes.functional as bnbf

    @torch.library.register_kernel("bitsandbytes::dequantize_4bit", "cpu")
    def _(A, absmax, blocksize, quant_type, shape, dtype):
        codes = A.reshape(-1).view(torch.uint8)
        nibbles = torch.stack([codes >> 4, codes & 15], dim=-1).reshape(-1).long()
        table = bnbf.get_4bit_type(quant_type, device="cpu")
        n = math.prod(shape)
        values = table[nibbles][:n]
        pad = (-n) % blocksize
        values = torch.nn.functional.pad(values, (0, pad)).view(-1, blocksize) * absmax.float().view(-1, 1)
        return values.reshape(-1)[:n].reshape(shape).to(dtype)


def golden(model_dir, out, *, r, alpha, batch, seq, rslora=False, qlora=None, save_adapter=None,
           dora=False, targets=LINEARS, weight_decay=0.0, autocast=False):
    """`model_dir` is a directory name relative to the current directory (it is recorded as is).

    `dora`: PEFT's use_dora. After A and B are drawn, each magnitude is set to PEFT's init formula
    on them, the row norms of W + scaling*B@A (W dequantized when NF4), so the golden's m is not
    just ||W||; the magnitudes are trained (and weight-decayed) like A and B.

    `autocast`: every forward and backward (the golden's, the base logits', the AdamW steps') runs
    under torch.autocast('cpu', dtype=torch.bfloat16) on the f32 model (f32 master weights, bf16
    products: linear, matmul, bmm, sdpa, the LoRA A/B linears included)."""
    import peft
    import transformers
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    kwargs = {}
    if qlora:
        from transformers import BitsAndBytesConfig
        kwargs = dict(device_map="cpu", quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=(qlora == "nf4-dq"),
            bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.uint8))
        nf4_dequantize_by_definition()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 **kwargs)
    config = model.config
    tensors = {}

    if qlora:
        # What a bnb-4bit checkpoint stores per quantized linear: the packed codes flattened to 1-D
        # uint8, then the packed quant state (absmax, quant_map, nested_* with double quant, and the
        # quant_state.bitsandbytes__nf4 JSON blob), under q.<module>.weight[.<field>].
        import bitsandbytes as bnb
        for name, module in model.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                tensors["q.%s.weight" % name] = module.weight.data.reshape(-1).clone()
                for field, t in module.weight.quant_state.as_dict(packed=True).items():
                    tensors["q.%s.weight.%s" % (name, field)] = t.clone()

    model = get_peft_model(model, LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none",
        task_type="CAUSAL_LM", use_rslora=rslora, init_lora_weights=True, use_dora=dora))

    # LoRA weights: one generator; modules in named_modules() order (layer 0 q,k,v,o,gate,up,down,
    # layer 1, ...); per module first A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming bound), then B.
    g = torch.Generator().manual_seed(LORA_SEED)
    n_modules = 0
    with torch.no_grad():
        for _, module in model.named_modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                bound = 1.0 / (a.shape[1] ** 0.5)
                a.copy_((torch.rand(a.shape, generator=g, dtype=torch.float32) * 2 - 1) * bound)
                b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float32) * B_STD)
                if dora:
                    from peft.utils.integrations import dequantize_module_weight
                    w = dequantize_module_weight(module.get_base_layer()).float()
                    s = module.scaling["default"]
                    module.lora_magnitude_vector["default"].weight.copy_(
                        torch.linalg.norm(w + s * (b @ a), dim=1))
                n_modules += 1
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_A." in n or ".lora_B." in n or (dora and ".lora_magnitude_vector." in n)
               for n, _ in params)
    init = {"init." + adapter_key(n): p.detach().float().clone() for n, p in params}
    if save_adapter:
        model.save_pretrained(save_adapter)
        os.remove(os.path.join(save_adapter, "README.md"))  # PEFT's model card, not needed

    # The batch: uniform token ids in [3, tokenizer vocab), BOS first, labels = ids with -100 prefix.
    from tokenizers import Tokenizer
    vocab = min(Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).get_vocab_size(),
                config.vocab_size)
    ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(SEED),
                        dtype=torch.int64)
    ids[:, 0] = config.bos_token_id
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :MASK_PREFIX] = -100

    def amp():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)

    model.train()  # no dropout anywhere, so the same numbers as eval
    with amp():
        out_ = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    out_.loss.backward()
    logits = out_.logits.detach().float()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size),
                                           labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(ce, out_.loss.detach().float(), rtol=1e-5, atol=1e-6)
    tensors.update({"input_ids": ids, "attention_mask": mask, "labels": labels, "logits": logits,
                    "loss": out_.loss.detach().float().reshape(1)})
    for i, h in enumerate(out_.hidden_states):  # 0 = embeddings, L = final norm output
        tensors["hidden_states.%d" % i] = h.detach().float()
    tensors.update(init)
    for n, p in params:
        tensors["grad." + adapter_key(n)] = p.grad.detach().float().clone()
    with torch.no_grad(), model.disable_adapter(), amp():
        tensors["base_logits"] = model(input_ids=ids, attention_mask=mask).logits.float()

    # 3 steps of torch.optim.AdamW on the same batch; adamw.loss[k] is the loss before update k.
    opt = torch.optim.AdamW([p for _, p in params], lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=weight_decay)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with amp():
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    tensors["adamw.loss"] = torch.tensor(losses, dtype=torch.float32)
    for n, p in params:
        tensors["adamw." + adapter_key(n)] = p.detach().float().clone()

    # Metadata "config": one JSON string; key order and values as the Rust tests and the committed
    # files expect (alpha is recorded as given: int 16 for golden_tiny, float 8.0 for the l3 ones).
    bnb_version = __import__("bitsandbytes").__version__ if qlora else None
    meta = {
        "model_dir": os.path.basename(os.path.normpath(model_dir)),
        "model_config": config.to_dict(),
        "r": r, "lora_alpha": alpha, "use_rslora": rslora,
        "scaling": alpha / (r ** 0.5 if rslora else r),
        "target_modules": targets, "lora_dropout": 0.0,
        "seed": SEED, "lora_seed": LORA_SEED, "b_std": B_STD,
        "batch": batch, "seq": seq, "mask_prefix": MASK_PREFIX,
        "dtype": "f32", "attn_implementation": "eager",
        "loss": LOSS_NOTE, "lora_forward": FORWARD_NOTE,
        "adamw": {"steps": STEPS, "lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": weight_decay,
                  "impl": ADAMW_NOTE},
        "n_lora_modules": n_modules,
        "qlora": qlora or "none", "qlora_note": QLORA_NOTE,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "bitsandbytes": bnb_version},
    }
    if dora:  # only in the DoRA goldens, so the older files' metadata stays byte-identical
        meta["use_dora"] = True
        meta["lora_forward"] = DORA_NOTE
    if autocast:  # likewise only in the autocast golden
        meta["autocast_bf16"] = True
    save_file({k: v.contiguous() for k, v in tensors.items()}, out,
              metadata={"config": json.dumps(meta, default=str)})
    print("%s: loss %.5f, %d tensors" % (out, out_.loss.item(), len(tensors)), flush=True)


GOLDENS = {
    # name: (model dir, keyword arguments)
    "golden_tiny": ("tiny", dict(r=8, alpha=16, batch=2, seq=16, save_adapter="adapter_tiny_init")),
    "golden_tiny_l3": ("tiny_l3", dict(r=4, alpha=8.0, batch=3, seq=40)),
    "golden_tiny_l3_rslora": ("tiny_l3", dict(r=4, alpha=8.0, batch=3, seq=40, rslora=True)),
    "golden_tiny_qlora_nf4": ("tiny", dict(r=8, alpha=16, batch=2, seq=16, qlora="nf4")),
    "golden_tiny_qlora_nf4dq": ("tiny", dict(r=8, alpha=16, batch=2, seq=16, qlora="nf4-dq")),
    # DoRA (tests/integration/dora.rs): all-linear on the untied GQA tiny model; a subset with
    # rsLoRA and weight decay on the tied tiny_l3 (GQA 4/1); QDoRA over NF4 double quant.
    "golden_tiny_dora": ("tiny", dict(r=8, alpha=16, batch=2, seq=16, dora=True)),
    "golden_tiny_l3_dora_rslora_wd": ("tiny_l3", dict(
        r=4, alpha=8.0, batch=3, seq=40, dora=True, rslora=True, weight_decay=0.1,
        targets=["q_proj", "v_proj", "o_proj", "down_proj"])),
    "golden_tiny_qdora_nf4dq": ("tiny", dict(r=8, alpha=16, batch=2, seq=16, qlora="nf4-dq",
                                             dora=True)),
    # bf16 autocast (issue 20): golden_tiny's model, init (adapter_tiny_init) and batch, every
    # forward/backward under torch.autocast('cpu', bfloat16); read by tests/integration/autocast.rs.
    "golden_tiny_autocast": ("tiny", dict(r=8, alpha=16, batch=2, seq=16, autocast=True)),
}

# What --check compares: file in OUT -> the committed file.
COMMITTED = {
    "golden_tiny.safetensors": "parity/golden_tiny.safetensors",
    "adapter_tiny_init/adapter_model.safetensors": "parity/adapter_tiny_init/adapter_model.safetensors",
    "golden_tiny_l3.safetensors": "parity/golden_tiny_l3.safetensors",
    "golden_tiny_l3_rslora.safetensors": "parity/golden_tiny_l3_rslora.safetensors",
    "golden_tiny_qlora_nf4.safetensors": "parity/golden_tiny_qlora_nf4.safetensors",
    "golden_tiny_qlora_nf4dq.safetensors": "parity/golden_tiny_qlora_nf4dq.safetensors",
    "golden_tiny_dora.safetensors": "parity/golden_tiny_dora.safetensors",
    "golden_tiny_l3_dora_rslora_wd.safetensors": "parity/golden_tiny_l3_dora_rslora_wd.safetensors",
    "golden_tiny_qdora_nf4dq.safetensors": "parity/golden_tiny_qdora_nf4dq.safetensors",
    "golden_tiny_autocast.safetensors": "parity/golden_tiny_autocast.safetensors",
}
for _d, _fixture in [("tiny", "tiny-llama"), ("tiny_l3", "tiny-llama3")]:
    for _f in os.listdir(os.path.join(REPO_TESTS, "fixtures", _fixture)):
        COMMITTED["%s/%s" % (_d, _f)] = "fixtures/%s/%s" % (_fixture, _f)


def check(out):
    """Byte comparison with the committed files; tensor-wise max |diff| where bytes differ."""
    from safetensors.torch import load_file
    bad = 0
    for mine, theirs in COMMITTED.items():
        a, b = os.path.join(out, mine), os.path.join(REPO_TESTS, theirs)
        if not os.path.exists(a):
            print("missing  %s" % mine)
            continue
        if filecmp.cmp(a, b, shallow=False):
            print("same     %s  %s" % (hashlib.sha256(open(a, "rb").read()).hexdigest(), theirs))
            continue
        bad += 1
        note = ""
        if a.endswith(".safetensors"):
            ta, tb = load_file(a), load_file(b)
            diffs = [(ta[k].double() - tb[k].double()).abs().max().item() for k in ta if k in tb]
            note = "(tensors: %d vs %d, max |diff| %g)" % (len(ta), len(tb), max(diffs, default=0.0))
        print("DIFFERS  %s %s" % (theirs, note))
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (made if missing)")
    ap.add_argument("--only", default=None, help="comma-separated golden names (default: all); the "
                    "models are always rebuilt")
    ap.add_argument("--check", action="store_true", help="compare OUT with the files under tests/")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.chdir(args.out)  # the goldens record the model directory name, so load it by a relative path
    make_models(".")
    for name in (args.only.split(",") if args.only else GOLDENS):
        model_dir, kw = GOLDENS[name]
        if "qlora" in kw:
            try:
                import bitsandbytes  # noqa: F401
            except ImportError:
                print("skipped %s: bitsandbytes is not installed" % name)
                continue
        if kw.get("save_adapter"):
            shutil.rmtree(kw["save_adapter"], ignore_errors=True)
        golden(model_dir, name + ".safetensors", **kw)
    if args.check:
        sys.exit(1 if check(".") else 0)


if __name__ == "__main__":
    main()
