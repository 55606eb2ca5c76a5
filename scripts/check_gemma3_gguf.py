"""Checks `rtune convert gguf` on Gemma 3 against transformers' own GGUF loader (an independent
reading of the same file: its tensor-name map, dequantization, Gemma's `norm - 1` and its
SentencePiece-to-tokenizers conversion) and against gguf-py's numpy dequantization (llama.cpp's
reference for the block formats).

    scripts/fetch-gemma3.sh
    cargo run --release -- convert gguf models/gemma-3-270m-q4_k_m.gguf /tmp/gemma3-hf
    pip install gguf sentencepiece protobuf   # transformers needs gguf to read GGUF
    python scripts/check_gemma3_gguf.py models/gemma-3-270m-q4_k_m.gguf /tmp/gemma3-hf

Checks, each printed, exit status 1 when one fails:
1. every converted tensor equals transformers' dequantization of the file (its loaded model's
   state dict, f32), tolerance 0: both sides decode the same blocks to f32 with the same
   operations, and subtract 1 from the norms in f32;
2. every converted tensor equals gguf-py's `dequantize` (minus 1 for `*norm.weight`), tolerance 0;
3. config.json: the keys transformers derives from the file agree (layer types, RoPE bases,
   head_dim, query_pre_attn_scalar, window, eps, sizes);
4. tokenizer.json: vocabulary, merges (order included) and added tokens equal those of
   transformers' tokenizer loaded from the GGUF, and token ids (and decoded text) equal on a
   multilingual sample, with and without special tokens;
5. logits of the converted directory equal those of the model transformers loads from the GGUF
   (max |diff| / max |logit| < 1e-5: same weights, same code, so 0 is expected).
"""

import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

TEXTS = [
    "How long does the Zephyr battery last?",
    "Der Wetterstation-Akku hält ungefähr achtzehn Monate; Größe, Übergröße, Straße.",
    "天气站的电池可以使用大约十八个月。北京、上海和广州。",
    "ゼファーの電池はどれくらい持ちますか？カタカナとひらがな、漢字。",
    "emoji 🙂🚀🌦️👩‍👩‍👧 and flags 🇳🇴🇩🇪",
    "def f(x):\n    return x ** 2  # square\n\tindented\twith\ttabs\n",
    "runs   of    spaces,\n\n\nnewlines,\r\n and trailing   ",
    "   leading spaces and numbers 1234567890 3.14159 -42",
    "<start_of_turn>user\nWho makes Zephyr?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>inline <eos> specials <pad> and <unk> and [multimodal]",
    "",
    " ",
    "Ελληνικά, русский, العربية, हिन्दी, 한국어, ไทย",
]


def check_tensors(gguf_path, converted, ref_model):
    from gguf import GGUFReader, dequantize

    ok = True
    conv = load_file(os.path.join(converted, "model.safetensors"))
    ref = {k: v for k, v in ref_model.state_dict().items()}
    tied = ref_model.config.tie_word_embeddings
    if tied:
        ref.pop("lm_head.weight", None)
    missing = sorted(set(ref) - set(conv))
    extra = sorted(set(conv) - set(ref))
    if missing or extra:
        print(f"tensor names DIFFER: missing {missing[:5]} extra {extra[:5]}")
        ok = False
    worst = 0.0
    for name in sorted(set(ref) & set(conv)):
        a, b = conv[name].float(), ref[name].float()
        if a.shape != b.shape:
            print(f"{name}: shape {tuple(a.shape)} vs transformers {tuple(b.shape)}")
            ok = False
            continue
        d = (a - b).abs().max().item()
        worst = max(worst, d)
        if d != 0.0:
            print(f"{name}: max |diff| vs transformers {d:.3e}")
            ok = False
    print(f"1. {len(conv)} tensors vs transformers' GGUF loader: max |diff| {worst:.3e}")

    # gguf-py, by llama.cpp name (names mapped as rtune maps them).
    layer = {
        "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    worst, types = 0.0, {}
    for t in GGUFReader(gguf_path).tensors:
        stem = t.name.removesuffix(".weight")
        if stem in top:
            hf = top[stem] + ".weight"
        else:
            _, i, s = stem.split(".", 2)
            hf = f"model.layers.{i}.{layer[s]}.weight"
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])
        if t.name.endswith("norm.weight"):
            w = w - np.float32(1)
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        d = float(np.abs(conv[hf].float().numpy() - w).max())
        worst = max(worst, d)
        if d != 0.0:
            print(f"{t.name} ({t.tensor_type.name}): max |diff| vs gguf-py {d:.3e}")
            ok = False
    print(f"2. vs gguf-py's dequantize ({types}): max |diff| {worst:.3e}")
    return ok


def check_config(gguf_dir, gguf_file, converted):
    ref = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    ours = AutoConfig.from_pretrained(converted)
    ok = True
    for k in ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
              "rms_norm_eps", "query_pre_attn_scalar", "sliding_window", "layer_types",
              "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
              "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation",
              "bos_token_id", "eos_token_id", "pad_token_id"]:
        a, b = getattr(ref, k, None), getattr(ours, k, None)
        if isinstance(a, float) and isinstance(b, float):
            same = abs(a - b) <= 1e-6 * abs(a)  # GGUF stores f32: 1e-6 reads as 9.99999997e-7
        else:
            same = a == b
        if not same:
            print(f"config `{k}`: transformers {a!r}, rtune {b!r}")
            ok = False
    print(f"3. config.json {'agrees' if ok else 'DIFFERS'}")
    return ok


def check_tokenizer(gguf_dir, gguf_file, converted):
    ref = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    ours = AutoTokenizer.from_pretrained(converted)
    ok = True
    a = json.loads(ref.backend_tokenizer.to_str())
    b = json.loads(ours.backend_tokenizer.to_str())
    for part in ["normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens"]:
        if a[part] != b[part]:
            print(f"tokenizer.json `{part}` differs:\n  transformers {str(a[part])[:300]}\n  rtune        {str(b[part])[:300]}")
            ok = False
    for k in ["type", "unk_token", "fuse_unk", "byte_fallback", "ignore_merges", "vocab"]:
        if a["model"][k] != b["model"][k]:
            print(f"tokenizer.json model `{k}` differs")
            ok = False
    ma, mb = a["model"]["merges"], b["model"]["merges"]
    if ma != mb:
        first = next((i for i, (x, y) in enumerate(zip(ma, mb)) if x != y), min(len(ma), len(mb)))
        print(f"merges differ ({len(ma)} vs {len(mb)}), first at {first}: "
              f"{ma[first:first + 2]} vs {mb[first:first + 2]}")
        ok = False
    print(f"4a. tokenizer.json: {len(a['model']['vocab'])} tokens, {len(ma)} merges, "
          f"{len(a['added_tokens'])} added tokens {'equal' if ok else 'DIFFER'}")
    for t in TEXTS:
        for special in [True, False]:
            x = ref(t, add_special_tokens=special)["input_ids"]
            y = ours(t, add_special_tokens=special)["input_ids"]
            same = x == y and ref.decode(x) == ours.decode(y)
            ok &= same
            if not same:
                print(f"tokens DIFFER (special={special}) on {t!r}:\n  transformers {x}\n  rtune        {y}")
        print(f"4b. tokens {'same' if x == y else 'DIFFER'} ({len(y)}): {t!r}")
    return ok


def main():
    gguf, converted = sys.argv[1], sys.argv[2]
    d, f = os.path.split(os.path.abspath(gguf))
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    ok = check_tensors(gguf, converted, ref)
    ok &= check_config(d, f, converted)
    ok &= check_tokenizer(d, f, converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(converted)
    ids = tok(TEXTS[8] + TEXTS[0] + " " + TEXTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"5. logits over {ids.shape[1]} tokens: max |diff| / max |logit| = {rel:.3e}")
    ok &= rel < 1e-5
    print("all checks pass" if ok else "SOME CHECKS FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
