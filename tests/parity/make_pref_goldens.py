#!/usr/bin/env python3
"""Goldens for rtune's preference objectives against TRL 1.16's trainers. Written for rtune; run with
the reference venv (torch, transformers, peft, trl):

    python tests/parity/make_pref_goldens.py

Writes tests/parity/golden_pref.safetensors. The model is tests/fixtures/tiny-llama (f32, eager
attention); the adapter PEFT LoRA r 4, alpha 8 on all seven projections, its A and B drawn from a
seeded 0.05·N(0, 1) (so the policy differs from the base and every gradient is non-zero), passed to
the trainer as a PeftModel: TRL then copies it into a frozen "ref" adapter, the reference policy
rtune uses with `[lora] init_from`.

How the batch is fixed on both sides: TRL tokenizes the text pairs below (`DPOTrainer`'s own
`_prepare_dataset`: EOS appended, the completion split where the tokenized prompt and prompt +
completion diverge); its `DataCollatorForPreference` makes one batch of all 4 pairs (chosen rows,
then rejected); `trainer.compute_loss` is called 3 times on that batch with torch.optim.AdamW (lr
1e-3, betas (0.9, 0.999), eps 1e-8, no weight decay, no clipping) between. rtune trains on the same
text rows with micro_batch_size 4, no shuffle, 3 steps: each step is the same 4 pairs.

`dpo_chat` trains on the same pairs as conversations (`chat_pairs`: TRL's conversational rows, the
tiny model's chat template; TRL's tokenization of them in `chat_ids`).

`kto`, `kto_weighted`: KTOTrainer on `kto_rows` (each pair's chosen as a desirable row, its
rejected as an undesirable one; one batch of 8, so TRL's KL completions, each row's previous row's
completion cycled within the batch, are fixed by the file's order); `kl` is logged per step.

Keys, for each variant V: `V.loss` [3] (before each step), `V.<metric>` [3] (TRL's logged metrics,
e.g. `V.rewards/chosen`), `V.adamw.<peft key>` (the adapter after 3 steps); `init.<peft key>`; the
TRL-tokenized pairs in the metadata (`pairs`), and the variants' settings (`variants`).

Mixture of experts (`--moe`, issue 45; writes tests/parity/golden_pref_moe.safetensors only): the
same text pairs on tests/fixtures/tiny-qwen3-moe (make_moe_goldens.py's Qwen3-MoE: routers N(0, 0.5),
`output_router_logits` with `router_aux_loss_coef` 0.1), tokenized by a character-level tokenizer
built here (the fixture has none; ids < its vocab of 256: pad 0, bos 1, eos 2, then the pairs'
characters in sorted order), LoRA r 4, alpha 8 on q/k/v/o and on both expert stacks
(`target_parameters`), A and B drawn as above. TRL adds `router_aux_loss_coef · aux_loss` to each
loss (the policy's forward over the whole batch: chosen then rejected rows for DPO, SimPO and ORPO,
the completion rows for KTO, not its KL rows); `V.aux_loss` [3] is the aux before the coefficient
(TRL's logged metric; ORPO and SimPO log none: read from their forward). The ids each trainer
tokenized in the metadata (`moe_pairs`, `moe_free_pairs`, `moe_kto_ids`), rtune trains on them.
"""
import argparse
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "..", "fixtures", "tiny-llama")
OUT = os.path.join(HERE, "golden_pref.safetensors")
MOE_MODEL = os.path.join(HERE, "..", "fixtures", "tiny-qwen3-moe")
MOE_OUT = os.path.join(HERE, "golden_pref_moe.safetensors")
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA, STEPS, LR = 4, 8.0, 3, 1e-3

# Text pairs (the tiny byte-level tokenizer: ~1 token a character); also written by the rtune test
# as its data file.
PAIRS = [
    {"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " five, I think"},
    {"prompt": "Q: sky?\nA:", "chosen": " blue", "rejected": " green"},
    {"prompt": "Name a fruit:", "chosen": " apple", "rejected": " a rock"},
    {"prompt": "Say hi.", "chosen": " Hi!", "rejected": " No."},
]

# The same pairs as conversations (TRL's conversational format): the tiny model's chat template
# renders them; TRL tokenizes the prompt with the generation prompt and prompt + completion without.
CHAT_PAIRS = [{"prompt": [{"role": "user", "content": p["prompt"]}],
               "chosen": [{"role": "assistant", "content": p["chosen"]}],
               "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in PAIRS]

# KTO's unpaired rows: each pair's chosen as desirable, its rejected as undesirable (8 rows, one
# batch; TRL's KL completions: each row's previous row's completion within the batch, cycled).
KTO_ROWS = [r for p in PAIRS for r in ({"prompt": p["prompt"], "completion": p["chosen"], "label": True},
                                       {"prompt": p["prompt"], "completion": p["rejected"], "label": False})]
KTO = {"kto": dict(beta=0.3, desirable_weight=1.0, undesirable_weight=1.0),
       "kto_weighted": dict(beta=0.2, desirable_weight=1.5, undesirable_weight=0.8)}

# Variant name -> DPOConfig settings.
VARIANTS = {
    "dpo_sigmoid": dict(loss_type=["sigmoid"], beta=0.1, label_smoothing=0.0),
    "dpo_sigmoid_b05": dict(loss_type=["sigmoid"], beta=0.5, label_smoothing=0.0),
    "dpo_hinge": dict(loss_type=["hinge"], beta=2.0, label_smoothing=0.0),
    "dpo_ipo": dict(loss_type=["ipo"], beta=0.1, label_smoothing=0.0),
    "dpo_robust": dict(loss_type=["robust"], beta=0.3, label_smoothing=0.1),
    "dpo_chat": dict(loss_type=["sigmoid"], beta=0.2, label_smoothing=0.0),
}
# The reference-free objectives, through TRL's experimental trainers (their own tokenization: the
# pairs they trained on are saved per variant, `V.pairs`, and rtune trains on those ids).
FREE = {
    "simpo": (CPOTrainer, CPOConfig, dict(loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=1.0,
                                          label_smoothing=0.0)),
    "simpo_ls": (CPOTrainer, CPOConfig, dict(loss_type="simpo", beta=2.5, simpo_gamma=1.0, cpo_alpha=0.5,
                                             label_smoothing=0.1)),
    "orpo": (ORPOTrainer, ORPOConfig, dict(beta=0.2)),
}
METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected"]

torch.use_deterministic_algorithms(True)


def peft_model(moe=False):
    model = AutoModelForCausalLM.from_pretrained(MOE_MODEL if moe else MODEL, dtype=torch.float32,
                                                 attn_implementation="eager")
    extra = dict(target_modules=MOE_TARGETS, target_parameters=MOE_PARAMS) if moe else dict(target_modules=TARGETS)
    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **extra)
    m = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in sorted(m.named_parameters()):
            if "lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return m


def peft_key(name):
    # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> PEFT's saved name
    return name.replace(".default", "")


def adamw_steps(name, model, step, names, out, modules=2 * len(TARGETS)):
    """STEPS AdamW steps of `model`'s default adapter (`modules` LoRA pairs) on `step()` (loss,
    TRL's logged metrics), the losses, the metrics `names` and the trained adapter into `out`
    under `name`."""
    model.train()
    # The default adapter's weights: TRL's frozen "ref" copy (DPO, KTO) is not trained.
    trained = [(n, p) for n, p in model.named_parameters() if "lora_" in n and ".default." in n]
    assert len(trained) == 2 * modules and all(p.requires_grad for _, p in trained), len(trained)
    opt = torch.optim.AdamW([p for _, p in trained], lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    losses, metrics = [], {k: [] for k in names}
    for _ in range(STEPS):
        loss, logged = step()
        losses.append(loss.item())
        for k in names:
            metrics[k].append(float(logged[k]))
        loss.backward()
        opt.step()
        opt.zero_grad()
    out[f"{name}.loss"] = torch.tensor(losses, dtype=torch.float32)
    for k, v in metrics.items():
        out[f"{name}.{k}"] = torch.tensor(v, dtype=torch.float32)
    for n, p in trained:
        out[f"{name}.adamw.{peft_key(n)}"] = p.detach().clone().contiguous()
    print(name, "losses", [f"{x:.6f}" for x in losses])


def logged_step(trainer, model, batch):
    """One `compute_loss` of a (stable) TRL trainer and the metrics it logged for it."""
    def step():
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(model, batch)
        return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return step


def run(name, settings, tok, out, meta, moe=None):
    m = peft_model(moe is not None)
    if "init.base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" not in out:
        for n, p in m.named_parameters():
            if "lora_" in n:
                out["init." + peft_key(n)] = p.detach().clone().contiguous()
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, per_device_train_batch_size=len(PAIRS), learning_rate=LR,
                         max_length=64, report_to=[], use_cpu=True, **settings)
        data = CHAT_PAIRS if name == "dpo_chat" else PAIRS
        trainer = DPOTrainer(model=m, args=args, train_dataset=Dataset.from_list(data), processing_class=tok)
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    key = "moe_pairs" if moe else "chat_ids" if name == "dpo_chat" else "pairs"
    if key not in meta:
        meta[key] = [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in rows]
    batch = trainer.data_collator([{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in rows])
    names, kw = (METRICS + ["aux_loss"], dict(modules=moe)) if moe else (METRICS, {})
    adamw_steps(name, trainer.model, logged_step(trainer, trainer.model, batch), names, out, **kw)


def split_pairs(batch):
    """TRL's padded (chosen|rejected)_(input_ids|labels) back into prompt / chosen / rejected ids."""
    out = []
    for i in range(batch["chosen_input_ids"].shape[0]):
        sides = []
        for side in ("chosen", "rejected"):
            ids = batch[f"{side}_input_ids"][i].tolist()
            labels = batch[f"{side}_labels"][i].tolist()
            n = int(batch[f"{side}_attention_mask"][i].sum())
            ids, labels = ids[:n], labels[:n]
            k = next(j for j, lab in enumerate(labels) if lab != -100)
            assert all(lab != -100 for lab in labels[k:]), labels
            sides.append((ids[:k], ids[k:]))
        assert sides[0][0] == sides[1][0], "one prompt"
        out.append({"prompt_ids": sides[0][0], "chosen_ids": sides[0][1], "rejected_ids": sides[1][1]})
    return out


def run_free(name, trainer_cls, config_cls, settings, tok, out, meta, moe=None):
    m = peft_model(moe is not None)
    with tempfile.TemporaryDirectory() as tmp:
        args = config_cls(output_dir=tmp, per_device_train_batch_size=len(PAIRS), learning_rate=LR,
                          max_length=64, report_to=[], use_cpu=True, **settings)
        trainer = trainer_cls(model=m, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    meta.setdefault("moe_free_pairs" if moe else "free_pairs", {})[name] = split_pairs(batch)
    model = trainer.model
    if not moe:
        adamw_steps(name, model, lambda: trainer.get_batch_loss_metrics(model, batch, "train"),
                    METRICS + ["nll_loss"], out)
        return
    # ORPO and CPO add `aux_loss_coef · aux_loss` to the loss but log no aux: read it from the
    # concatenated forward's output (its 6th item when the aux is on).
    assert trainer.aux_loss_enabled and trainer.aux_loss_coef > 0
    seen, forward = {}, trainer.concatenated_forward

    def recorded(model, batch):
        outputs = forward(model, batch)
        seen["aux_loss"] = outputs[5].item()
        return outputs

    trainer.concatenated_forward = recorded

    def step():
        loss, metrics = trainer.get_batch_loss_metrics(model, batch, "train")
        return loss, {**metrics, **seen}
    adamw_steps(name, model, step, METRICS + ["nll_loss", "aux_loss"], out, modules=moe)


def run_kto(name, settings, tok, out, meta, moe=None):
    m = peft_model(moe is not None)
    with tempfile.TemporaryDirectory() as tmp:
        args = KTOConfig(output_dir=tmp, per_device_train_batch_size=len(KTO_ROWS), learning_rate=LR,
                         max_length=64, report_to=[], use_cpu=True, **settings)
        trainer = KTOTrainer(model=m, args=args, train_dataset=Dataset.from_list(KTO_ROWS), processing_class=tok)
    keys = ("prompt_ids", "completion_ids", "KL_completion_ids", "label")
    rows = [{k: trainer.train_dataset[i][k] for k in keys} for i in range(len(KTO_ROWS))]
    meta.setdefault("moe_kto_ids" if moe else "kto_ids", rows)
    batch = trainer.data_collator(rows)
    names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"]
    names, kw = (names + ["aux_loss"], dict(modules=moe)) if moe else (names, {})
    adamw_steps(name, trainer.model, logged_step(trainer, trainer.model, batch), names, out, **kw)


def char_tokenizer():
    """The MoE fixture's tokenizer: one id a character of the pairs (pad 0, bos 1, eos 2, then the
    characters in sorted order), a BPE with no merges."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    chars = sorted({c for p in PAIRS for v in p.values() for c in v})
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])),
                                  pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    assert tok("Q: 2+2?")["input_ids"] == [vocab[c] for c in "Q: 2+2?"]
    return tok


# The MoE goldens: objective -> settings (one of each trainer that adds the aux loss).
MOE_DPO = {"dpo": dict(loss_type=["sigmoid"], beta=0.1, label_smoothing=0.0)}
MOE_FREE = {"orpo": FREE["orpo"], "simpo": FREE["simpo"]}
MOE_KTO = {"kto": KTO["kto"]}


def main_moe():
    """golden_pref_moe.safetensors (see the docstring)."""
    import trl
    tok = char_tokenizer()
    with open(os.path.join(MOE_MODEL, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["output_router_logits"] and cfg["router_aux_loss_coef"] == 0.1
    # q/k/v/o on 3 layers, the two expert stacks on the 2 sparse ones.
    modules = 3 * len(MOE_TARGETS) + 2 * len(MOE_PARAMS)
    out, meta = {}, {}
    for name, settings in MOE_DPO.items():
        run(name, settings, tok, out, meta, moe=modules)
    for name, (trainer_cls, config_cls, settings) in MOE_FREE.items():
        run_free(name, trainer_cls, config_cls, settings, tok, out, meta, moe=modules)
    for name, settings in MOE_KTO.items():
        run_kto(name, settings, tok, out, meta, moe=modules)
    meta.update(r=R, lora_alpha=ALPHA, target_modules=MOE_TARGETS, target_parameters=MOE_PARAMS,
                steps=STEPS, lr=LR, router_aux_loss_coef=cfg["router_aux_loss_coef"],
                variants={k: {**v, "loss_type": v["loss_type"][0]} for k, v in MOE_DPO.items()},
                free_variants={k: v[2] for k, v in MOE_FREE.items()}, kto_variants=MOE_KTO,
                versions={"torch": torch.__version__, "trl": trl.__version__})
    save_file(out, MOE_OUT, metadata={"config": json.dumps(meta)})
    print("wrote", MOE_OUT)


def main():
    import trl
    tok = AutoTokenizer.from_pretrained(MODEL)
    out, meta = {}, {}
    for name, settings in VARIANTS.items():
        run(name, settings, tok, out, meta)
    for name, (trainer_cls, config_cls, settings) in FREE.items():
        run_free(name, trainer_cls, config_cls, settings, tok, out, meta)
    meta["free_variants"] = {k: v[2] for k, v in FREE.items()}
    for name, settings in KTO.items():
        run_kto(name, settings, tok, out, meta)
    meta.update(kto_rows=KTO_ROWS, kto_variants=KTO)
    meta.update(r=R, lora_alpha=ALPHA, target_modules=TARGETS, steps=STEPS, lr=LR, text_pairs=PAIRS,
                chat_pairs=CHAT_PAIRS,
                variants={k: {**v, "loss_type": v["loss_type"][0]} for k, v in VARIANTS.items()},
                versions={"torch": torch.__version__, "trl": trl.__version__})
    save_file(out, OUT, metadata={"config": json.dumps(meta)})
    print("wrote", OUT)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", action="store_true", help="write golden_pref_moe.safetensors (only)")
    if ap.parse_args().moe:
        main_moe()
    else:
        main()
