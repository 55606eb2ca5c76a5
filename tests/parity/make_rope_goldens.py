#!/usr/bin/env python3
"""RoPE frequency goldens: transformers 5.24's own `ROPE_INIT_FUNCTIONS` (default, linear, llama3,
longrope, yarn) on small configs, written as `tests/parity/rope_freqs.json`. Written for rtune; run
with the reference venv from the repository root:

    python tests/parity/make_rope_goldens.py

Each case holds the `config.json` keys it was made from (`config`: what rtune's config reader
reads), the rope parameters as the init function used them, after transformers'
`standardize_rope_params` (`rope_parameters`: what rtune's `RopeScaling` holds), the rotated width `dim`, the frequencies `inv_freq` (f32 values,
written as the exact decimal of each) and the `attention_factor` cos and sin are multiplied by.
LongRoPE cases give both sets (`seq_len` at and past the pre-training length). Read by
`crates/ops/src/rope/tests.rs` (the tables, bit for bit) and `crates/model/tests/rope_config.rs`
(config.json to tables). Deterministic: no randomness, CPU, f32.
"""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

HERE = os.path.dirname(os.path.abspath(__file__))

# (name, config class, config.json keys)
CASES = [
    ("default", LlamaConfig, dict(head_dim=64, rope_theta=10000.0)),
    ("linear", LlamaConfig, dict(head_dim=24, rope_theta=1e6,
                                 rope_scaling={"rope_type": "linear", "factor": 4.0})),
    ("llama3", LlamaConfig, dict(head_dim=128, rope_theta=5e5, max_position_embeddings=131072,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192})),
    # gpt-oss-20b's RoPE: truncate false.
    ("yarn_gpt_oss", LlamaConfig, dict(head_dim=64, rope_theta=150000.0, max_position_embeddings=131072,
                                       rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False,
                                                     "original_max_position_embeddings": 4096})),
    # Qwen2.5's long-context recipe (v4 spelling `type`), truncate default (true).
    ("yarn_qwen", LlamaConfig, dict(head_dim=128, rope_theta=1e6, max_position_embeddings=131072,
                                    rope_scaling={"type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768})),
    # DeepSeek-style mscale / mscale_all_dim, other betas.
    ("yarn_mscale", LlamaConfig, dict(head_dim=64, rope_theta=10000.0, max_position_embeddings=163840,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                                       "beta_fast": 16, "beta_slow": 2, "mscale": 1.0,
                                                       "mscale_all_dim": 0.8,
                                                       "original_max_position_embeddings": 4096})),
    # An explicit attention factor; the pre-training length at the top level of config.json wins
    # over the set's.
    ("yarn_attention_factor", LlamaConfig, dict(head_dim=16, rope_theta=10000.0, max_position_embeddings=64,
                                                original_max_position_embeddings=16,
                                                rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                              "attention_factor": 1.25,
                                                              "original_max_position_embeddings": 8})),
    # A tiny range: low and high collapse to the same pair (transformers' +0.001).
    ("yarn_tiny", LlamaConfig, dict(head_dim=8, rope_theta=10000.0, max_position_embeddings=32,
                                    rope_scaling={"rope_type": "yarn", "factor": 2.0, "beta_fast": 4,
                                                  "beta_slow": 3.5, "original_max_position_embeddings": 16})),
    ("longrope", Phi3Config, dict(head_dim=16, hidden_size=64, num_attention_heads=4, rope_theta=10000.0,
                                  max_position_embeddings=256, original_max_position_embeddings=8,
                                  rope_scaling={"type": "longrope",
                                                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 4.0],
                                                "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0]})),
]


def exact(xs):
    """f32 values as Python floats: each the exact value, which json writes so it reads back."""
    return [float(x) for x in xs.to(torch.float32).tolist()]


def main():
    cases = []
    for name, cls, keys in CASES:
        base = dict(hidden_size=keys.get("hidden_size", 64), num_attention_heads=keys.get("num_attention_heads", 4))
        cfg = cls(**{**base, **keys})
        params = dict(cfg.rope_parameters)
        kind = params["rope_type"]
        dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
        case = dict(name=name, config={**base, **keys}, rope_parameters=params, dim=dim)
        if kind == "default":
            # transformers 5 computes the default in each model's rotary class.
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
            inv, att = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
        elif kind == "longrope":
            orig = params["original_max_position_embeddings"]
            inv, att = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=orig)
            long, att_long = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=orig + 1)
            assert att == att_long
            case["inv_freq_long"] = exact(long)
        else:
            inv, att = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        # After the call: the init functions standardize the parameters again, and then a
        # top-level `original_max_position_embeddings` has replaced the set's.
        case["rope_parameters"] = dict(cfg.rope_parameters)
        case["inv_freq"] = exact(inv)
        case["attention_factor"] = float(att)
        cases.append(case)
    out = os.path.join(HERE, "rope_freqs.json")
    with open(out, "w") as f:
        json.dump(dict(made_by="tests/parity/make_rope_goldens.py", torch=torch.__version__,
                       transformers=__import__("transformers").__version__, cases=cases), f, indent=1)
        f.write("\n")
    print(f"wrote {out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
