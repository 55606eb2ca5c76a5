"""Checks `rtune convert gguf` against transformers' own GGUF loader (an independent reading of the
same file: its tensor-name map, Q/K un-permutation, dequantization and tokenizer converter).

    scripts/fetch-smollm2.sh
    cargo run --release -- convert gguf models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-hf
    pip install gguf   # transformers needs it to read GGUF
    python scripts/check_gguf_import.py models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-hf

Prints the largest logit difference and exits 1 when token ids differ or logits differ by more than
1e-4 relative (both sides dequantize the same blocks to f32; only summation order may differ)."""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXTS = [
    "How long does the Zephyr battery last?",
    "  spaces\tand\nnewlines, ünïcödé, 日本語, emoji 🙂, numbers 1234567 and code: x += 1;",
    "<|im_start|>user\nWho makes Zephyr?<|im_end|>\n<|im_start|>assistant\n",
]


def main():
    gguf, converted = sys.argv[1], sys.argv[2]
    d, f = os.path.split(os.path.abspath(gguf))
    ref_tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok = AutoTokenizer.from_pretrained(converted)
    ok = True
    for t in TEXTS:
        a, b = ref_tok(t)["input_ids"], tok(t)["input_ids"]
        same = a == b and ref_tok.decode(a) == tok.decode(b)
        ok &= same
        print(f"tokens {'same' if same else 'DIFFER'} ({len(b)}): {t!r}")
        if not same:
            print("  transformers:", a, "\n  rtune:       ", b)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    ids = tok(TEXTS[2] + TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"logits over {ids.shape[1]} tokens: max |diff| / max |logit| = {rel:.3e}")
    ok &= rel < 1e-4
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
