#!/usr/bin/env python3
"""GRPO parity (issue 44): rtune's own completions replayed through TRL 1.16's GRPOTrainer.

    /work/.venv-ref/bin/python tests/parity/grpo_replay.py [--rtune target/debug/rtune] [--variant NAME] [--moe]

For each variant: rtune trains 3 steps on the tiny Llama (f32 CPU, LoRA r 4 on every linear layer,
started from one PEFT adapter this script writes with random A and B, so that the policy is not
the base and the KL term is not zero); then TRL trains from the same adapter on the same batches:
- the completions are fed to TRL through `rollout_func` (TRL's hook for custom generation): for
  each generation batch it returns rtune's `prompt_ids` and `completion_ids` from rollouts.jsonl,
  in rtune's order (the dataset is rtune's prompts in generation order, `shuffle_dataset=False`);
- each rtune reward function is a TRL reward function returning rtune's value for that completion
  (null as None), with the same weights: TRL forms the rewards' total and the advantages itself;
- prompts are pre-tokenized and of one length, so TRL's left padding adds no pad and the
  positions equal rtune's;
- TRL's shuffle of a generation batch before it is split into micro-batches
  (`shuffle_sequence_dict`, a `torch.randperm`) is replaced by rtune's order of that batch (each
  rollouts.jsonl line's `train_row`): with `steps_per_generation` 2 (`spg2`) the micro-batches
  are the same completions in the same rows on both sides.
Compared: every step's loss (rtune's metrics.jsonl vs the value TRL's compute_loss returns, not its
4-digit log) within 1e-5 relative (to max(|TRL's loss|, 1e-2): an on-policy step whose completions
share a length has a loss of 0 up to summation order, ~1e-8), every step's `entropy` metric (the
masked mean token entropy of softmax(z / T), read from TRL's `_metrics` as compute_loss appends
it; one micro-batch a step, so TRL's mean over micro-batches is that one value) within 1e-5
relative (f32 log-sum-exps of ~6-sized values over two forwards of slightly different adapters
after step 1), and the adapter after 3 AdamW steps within 1e-4 (max |Δ| / max |w| per tensor). f32 both (TRL's configs default to bf16: set off).
The prompts include one without an `answer` (its command reward is null) and the batches hold a
group whose rewards are all equal (frac_reward_zero_std 0.5 at step 3). Exit 1 on any failure.

Measured (AMD EPYC, 2 cores, lr 1e-3, temperature 0.9), all 12 variants ok: loss ≤ 3.0e-6,
adapter ≤ 4.9e-5 (cispo; the others ≤ 2.1e-5). Entropy (run for dapo, mask_truncated, beta,
sequence, mu2, batch_scale): ≤ 8.7e-8 relative. spg2 (2026-12-06, branch grpo2): loss 3.6e-7, entropy
1.0e-7, adapter 1.2e-6; dapo rerun beside it: loss 3.2e-6, entropy 4.0e-8, adapter 3.3e-6.

`--moe` (issue 45): the same on a tiny random Qwen3-MoE this script makes (tests/fixtures/
tiny-qwen3-moe's shape and init with the tiny Llama's vocabulary and tokenizer; `output_router_logits`,
`router_aux_loss_coef` 0.1), LoRA on q/k/v/o and on the expert stacks (`target_parameters`): TRL's
GRPOTrainer adds `router_aux_loss_coef · aux_loss / gradient_accumulation_steps` of the policy's
forward (prompt and completion under its attention mask; a completion masked as truncated is out of
it), about 0.3 of each loss here. Measured (2026-12-06, AMD EPYC, load 9): every variant's loss
≤ 5.8e-7 and entropy ≤ 9.6e-8; the adapter ≤ 6.9e-5 for 9 of the 13, 1.35e-4 for grpo, dr_grpo and
sapo and 1.06e-4 for spg2 (exit 1): each time one element of an expert stack's LoRA whose first
TRL gradient is f32 noise (1.6e-8, −6.3e-9), which AdamW's first update g / (|g| + 1e-8) turns
into a full-size step of either sign (the LR note below). rtune without the aux (share 0): loss
rel 1.0 (grpo); without leaving the truncated completions out: 1.4e-1 (mask_truncated).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer import grpo_trainer as grpo_trainer_module

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests/fixtures/tiny-llama"
G, MBS, STEPS, MAX_NEW = 4, 8, 3, 8
TEMP = float(os.environ.get("GRPO_PARITY_TEMPERATURE", "0.9"))
# AdamW's first update is g / (|g| + 1e-8) per element: an element whose gradient is ~1e-7 (pure
# cancellation) turns f32 rounding into an update difference of up to lr × 1e-2; at lr 1e-2 one
# such element of up_proj's A measured 1.07e-4 after 3 steps (every other tensor ≤ 1.2e-5).
LR = float(os.environ.get("GRPO_PARITY_LR", "1e-3"))

VARIANTS = {
    "dapo": {},
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "beta": {"beta": 0.1},
    "batch_scale": {"scale_rewards": "batch"},
    "no_scale": {"scale_rewards": "none"},
    "sequence": {"importance_sampling_level": "sequence"},
    "mu2": {"num_iterations": 2},
    "mask_truncated": {"mask_truncated_completions": True},
    "cispo": {"loss_type": "cispo"},
    "sapo": {"loss_type": "sapo"},
    # Two optimizer steps a generation batch of 16: the micro-batches are rtune's shuffle of it.
    "spg2": {"steps_per_generation": 2},
}


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


# `--moe`: LoRA on q/k/v/o and, through `target_parameters`, on the expert stacks.
MOE_LORA = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
LORA = dict(target_modules="all-linear")


def make_moe(path):
    """`--moe`: a tiny random Qwen3-MoE as make_moe_goldens.py makes tests/fixtures/tiny-qwen3-moe
    (3 layers, layer 1 dense; 8 experts, top-2; routers N(0, 0.5); `output_router_logits` with
    `router_aux_loss_coef` 0.1) with the tiny Llama's vocabulary and tokenizer (the sampled ids
    are decoded for the rewards), saved under `path`."""
    import shutil
    from transformers import Qwen3MoeConfig
    tok = AutoTokenizer.from_pretrained(MODEL)
    cfg = Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        max_position_embeddings=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], output_router_logits=True,
        router_aux_loss_coef=0.1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.1)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(MODEL / f, path)


def init_adapter(path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **LORA)
    m = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    m.save_pretrained(path)


def write_prompts(path):
    # Eight prompts of six tokens each (ids from the tiny vocabulary, BOS first), with answers.
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(8):
        ids = [1] + torch.randint(3, 500, (5,), generator=g).tolist()
        row = {"prompt_ids": ids, "answer": "e" if i % 2 else "a"}
        if i == 7:
            # No answer: the command reward gives null for its completions (TRL's None → NaN).
            del row["answer"]
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_rtune(rtune, work, variant, knobs):
    out = work / f"rtune-{variant}"
    lines = [
        f'[model]\npath = "{MODEL}"\ndtype = "f32"',
        f'[lora]\nr = 4\nalpha = 8\ninit_from = "{work / "init"}"\n'
        + "".join(f"{k.replace('_modules', 's')} = {json.dumps(v)}\n" for k, v in LORA.items()
                  if LORA is MOE_LORA),
        f'[data]\ntrain = "{work / "prompts.jsonl"}"\nmax_seq_len = 32',
        f"[train]\nseed = 3\nsteps = {STEPS}\nmicro_batch_size = 8\ngrad_accum = 1\nlr = {LR}",
        'schedule = "constant"\nmax_grad_norm = 1.0\nobjective = "grpo"',
        f"num_generations = {G}\nmax_completion_length = {MAX_NEW}\ntemperature = {TEMP}",
    ]
    lines += [f"{k} = {toml_value(v)}" for k, v in knobs.items()]
    lines += [
        f'[output]\ndir = "{out}"\nsave_every = 0',
        '[[reward]]\nname = "format"\nkind = "regex"\npattern = "e"',
        f'[[reward]]\nname = "judge"\nkind = "command"\nweight = 0.5\n'
        f'command = ["python3", "{ROOT / "examples/rewards/contains_answer.py"}"]',
    ]
    cfg = work / f"{variant}.toml"
    cfg.write_text("\n".join(lines) + "\n")
    subprocess.run([rtune, "train", "--config", str(cfg)], check=True, cwd=ROOT)
    rollouts = [json.loads(l) for l in (out / "rollouts.jsonl").read_text().splitlines()]
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    entropies = [m["entropy"] for m in metrics if "loss" in m]
    print("rtune grad norms", [m["grad_norm"] for m in metrics if "loss" in m])
    return out, rollouts, losses, entropies


class Replay(GRPOTrainer):
    losses = []
    entropies = []
    grad_norms = []
    grads = []

    def compute_loss(self, model, inputs, *a, **k):
        loss = super().compute_loss(model, inputs, *a, **k)
        Replay.losses.append(loss.item())
        Replay.entropies.append(self._metrics["train"]["entropy"][-1])
        if os.environ.get("GRPO_PARITY_VERBOSE"):
            for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"):
                print(key, inputs[key].tolist())
        return loss


def run_trl(work, rollouts, knobs):
    gen = MBS * knobs.get("steps_per_generation", 1)
    batches = [rollouts[i : i + gen] for i in range(0, len(rollouts), gen)]
    queue = list(batches)
    current = {}

    def rtune_order(seq_dict):
        # In place of TRL's shuffle_sequence_dict (a torch.randperm): rtune's training order of
        # the batch, each line's `train_row`, applied to every per-completion value alike.
        batch = current["batch"]
        perm = [0] * len(batch)
        for i, r in enumerate(batch):
            perm[r["train_row"]] = i
        out = {}
        for key, v in seq_dict.items():
            if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
                out[key] = v
            elif isinstance(v, torch.Tensor):
                out[key] = v[torch.tensor(perm)]
            else:
                out[key] = [v[i] for i in perm]
        return out

    grpo_trainer_module.shuffle_sequence_dict = rtune_order

    def rollout_func(prompts, trainer):
        batch = queue.pop(0)
        assert len(batch) == len(prompts), (len(batch), len(prompts))
        current["batch"] = batch
        return {
            "prompt_ids": [r["prompt_ids"] for r in batch],
            "completion_ids": [r["completion_ids"] for r in batch],
            "logprobs": None,
        }

    def reward(name):
        def f(prompts, completions, **kw):
            return [r["rewards"][name] for r in current["batch"]]

        f.__name__ = name
        return f

    # The dataset: one row per prompt in generation order (TRL repeats each G times).
    rows = [{"prompt": f"p{r['prompt_index']}"} for b in batches for r in b[::G]]
    tok = AutoTokenizer.from_pretrained(MODEL)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, work / "init", is_trainable=True)
    args = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=MBS,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=MAX_NEW,
        temperature=TEMP,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's configs default to bf16 autocast: the comparison is f32
        shuffle_dataset=False,
        seed=3,
        reward_weights=[1.0, 0.5],
        **knobs,
    )
    Replay.losses, Replay.entropies, Replay.grad_norms, Replay.grads = [], [], [], []

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            g = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            Replay.grads.append(g)
            Replay.grad_norms.append(torch.sqrt(sum((x.double() ** 2).sum() for x in g.values())).item())

    t = Replay(
        model=model,
        processing_class=tok,
        args=args,
        train_dataset=Dataset.from_list(rows),
        reward_funcs=[reward("format"), reward("judge")],
        rollout_func=rollout_func,
        callbacks=[Grads()],
    )
    t.train()
    return list(Replay.losses), list(Replay.entropies), get_peft_model_state_dict(t.model)


def compare(variant, knobs, rtune, work):
    out, rollouts, rl, re = run_rtune(rtune, work, variant, knobs)
    tl, te, state = run_trl(work, rollouts, knobs)
    print("trl grad norms", Replay.grad_norms)
    ok = True
    # Relative to TRL's loss, or to 1e-2 where it is smaller (an on-policy step whose advantages
    # sum to 0 has a loss of 0 up to the order of the sum).
    loss_rel = max(abs(a - b) / max(abs(b), 1e-2) for a, b in zip(rl, tl))
    if len(rl) != STEPS or len(tl) != STEPS or loss_rel > 1e-5:
        ok = False
    # An all-masked step (every completion truncated, mask_truncated) logs 0 on both sides.
    ent_rel = max(abs(a - b) / max(abs(b), 1e-2) for a, b in zip(re, te))
    if len(re) != STEPS or len(te) != STEPS or ent_rel > 1e-5:
        ok = False
    ours = load_file(out / "adapter_model.safetensors")
    worst = 0.0
    for k, v in state.items():
        w = ours[k]
        rel = (w - v).abs().max().item() / max(v.abs().max().item(), 1e-12)
        if os.environ.get("GRPO_PARITY_VERBOSE"):
            i = (w - v).abs().argmax()
            g = [s[k.replace(".weight", ".default.weight")].flatten()[i].item() for s in Replay.grads]
            print(f"  {k}: {rel:.2e} (worst element's TRL gradient by step: {g})")
        worst = max(worst, rel)
    if worst > 1e-4:
        ok = False
    print(f"{variant}: losses rtune {rl} trl {tl}; entropy rtune {re} trl {te}")
    print(f"{variant}: loss rel {loss_rel:.2e}, entropy rel {ent_rel:.2e}, adapter rel {worst:.2e}: "
          f"{'ok' if ok else 'FAIL'}")
    return ok


def main():
    global STEPS, MODEL, LORA
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", action="store_true",
                    help="a tiny Qwen3-MoE (the load-balancing loss in every loss; issue 45)")
    ap.add_argument("--rtune", default=str(ROOT / "target/debug/rtune"))
    ap.add_argument("--variant", action="append")
    ap.add_argument("--steps", type=int, default=STEPS)
    a = ap.parse_args()
    STEPS = a.steps
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    work = Path(tempfile.mkdtemp(prefix="grpo-parity-"))
    if a.moe:
        make_moe(work / "moe")
        MODEL, LORA = work / "moe", MOE_LORA
    init_adapter(work / "init")
    write_prompts(work / "prompts.jsonl")
    ok = all([compare(v, VARIANTS[v], a.rtune, work) for v in (a.variant or VARIANTS)])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
