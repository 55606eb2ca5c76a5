#!/usr/bin/env python3
"""Chat-template goldens made by transformers itself, for crates/data/tests/chat_parity.rs.

For each real template in templates/ this builds a tiny tokenizer directory in models/<name>/
(tiny-llama's byte-level BPE plus the model's special tokens, its BOS added by the post-processor
as the real tokenizer does, tokenizer_config.json holding the template) and renders a set of
conversations with `tokenizer.apply_chat_template` (tokenize=False, and tokenize=True for the ids).
Errors raised by the template (`raise_exception`) are recorded instead of a text.

The expected loss mask is written independently of rtune's prefix-diff algorithm: for each
assistant message, the text the template is known to print for it (written out per template
below, e.g. Llama-3.2's `content | trim + "<|eot_id|>"`), found in the render in order; the labels
keep exactly the tokens overlapping those texts.

Run from the repository root with the reference venv (transformers 5.24.0, tokenizers 0.23.3,
jinja2 3.1.6):
    python crates/data/tests/chat/make_goldens.py
Reruns are byte-identical except for the date in the Llama-3.2 case that uses strftime_now, which
is stored as the placeholder {TODAY}.
"""

import json
import time
from pathlib import Path

import jinja2
import tokenizers
import transformers
from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
BASE = ROOT / "tests/fixtures/tiny-llama/tokenizer.json"
PINNED_DATE = "07 Dec 2024"

# name: template file, special tokens (added as special), other added tokens, the special-token
# map of tokenizer_config.json, and the token the post-processor puts first (None: nothing).
MODELS = {
    "llama-3.2": dict(
        template="llama-3.2-instruct.jinja",
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        added=[],
        tokens=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
        post_bos="<|begin_of_text|>",
    ),
    "qwen2.5": dict(
        template="qwen2.5-instruct.jinja",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=["<tool_call>", "</tool_call>"],
        tokens=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        post_bos=None,
    ),
    "mistral-v0.2": dict(
        template="mistral-7b-instruct-v0.2.jinja",
        specials=["<unk>"],
        added=[],
        tokens=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
        post_bos="<s>",
    ),
    "gemma-2": dict(
        template="gemma-2-it.jinja",
        specials=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        added=[],
        tokens=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
        post_bos="<bos>",
    ),
    "deepseek-coder": dict(
        template="deepseek-coder-instruct.jinja",
        specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|EOT|>"],
        added=[],
        tokens=dict(bos_token="<｜begin▁of▁sentence｜>", eos_token="<|EOT|>"),
        post_bos="<｜begin▁of▁sentence｜>",
    ),
    "mistral-nemo": dict(
        template="mistral-nemo-instruct-2407.jinja",
        specials=["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        added=[],
        tokens=dict(bos_token="<s>", eos_token="</s>"),
        post_bos="<s>",
    ),
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}]
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}


def u(c):
    return {"role": "user", "content": c}


def a(c):
    return {"role": "assistant", "content": c}


SINGLE = [u("What is 2+2?"), a("2+2 is 4.")]
# `tool_calls: None` as OpenAI-style exports write it: transformers drops null keys, without which
# Llama-3.2's `'tool_calls' in message` would take the tool-call branch.
MULTI = [u("Hi there"), dict(a("Hello! How can I help?"), tool_calls=None), u("Name a colour."),
         a("Blue.")]
SYSTEM_MULTI = [{"role": "system", "content": "You are terse."}, u("Capital of France?"),
                a("Paris."), u("And of Italy?"), a("Rome.")]
WHITESPACE = [u("  Ünïcödé? 😀  "), a("  Ja — ça va.\n\n")]
BAD_ORDER = [u("First."), u("Second?"), a("Both noted.")]
TOOL_CHAT = [u("Weather in Paris?"),
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
              "content": "{\"temp\": 21.5}"},
             a("It is 21.5 °C in Paris.")]

# (case name, messages, tools, add_generation_prompt, models it applies to (None: all))
CASES = [
    ("single", SINGLE, None, False, None),
    ("multi", MULTI, None, False, None),
    ("system_multi", SYSTEM_MULTI, None, False, None),
    ("whitespace_unicode", WHITESPACE, None, False, None),
    ("generation_prompt", SYSTEM_MULTI[:2], None, True, None),
    ("generation_prompt_no_system", [u("Hello?")], None, True, None),
    ("bad_role_order", BAD_ORDER, None, False, None),
    ("tools", TOOL_CHAT, TOOLS, False, {"llama-3.2", "qwen2.5", "mistral-nemo"}),
    ("tools_generation_prompt", TOOL_CHAT[:1], TOOLS, True, {"llama-3.2", "qwen2.5"}),
]


def expected_turn(model, m):
    """The text the template prints for assistant message m, through its end-of-turn token."""
    calls = m.get("tool_calls")
    content = m.get("content")
    if model == "llama-3.2":
        if calls:
            f = calls[0]["function"]
            return ('{"name": "' + f["name"] + '", "parameters": '
                    + json.dumps(f["arguments"], ensure_ascii=False) + "}<|eot_id|>")
        return content.strip() + "<|eot_id|>"
    if model == "qwen2.5":
        if calls:
            s = content + "\n" if content else ""
            for c in calls:
                f = c["function"]
                s += ('<tool_call>\n{"name": "' + f["name"] + '", "arguments": '
                      + json.dumps(f["arguments"], ensure_ascii=False) + "}\n</tool_call>")
            return s + "<|im_end|>"
        return content + "<|im_end|>"
    if model == "mistral-v0.2":
        return content + "</s>"
    if model == "gemma-2":
        return content.strip() + "<end_of_turn>"
    if model == "deepseek-coder":
        return content + "\n<|EOT|>"
    if model == "mistral-nemo":
        if calls:
            parts = [json.dumps(c["function"], ensure_ascii=False)[:-1] + ', "id": "' + c["id"] + '"}'
                     for c in calls]
            return "[TOOL_CALLS][" + ", ".join(parts) + "]</s>"
        return content + "</s>"
    raise ValueError(model)


def build_model(name, spec):
    tok = Tokenizer.from_file(str(BASE))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["specials"]])
    if spec["added"]:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    j = json.loads(tok.to_str())
    bos = spec["post_bos"]
    if bos is None:
        j["post_processor"] = None
    else:
        bid = tok.token_to_id(bos)
        j["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bid], "tokens": [bos]}},
        }
    out = HERE / "models" / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(j, ensure_ascii=False, indent=1) + "\n")
    template = (HERE / "templates" / spec["template"]).read_text()
    cfg = dict(spec["tokens"])
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False,
               model_max_length=4096, chat_template=template)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1) + "\n")
    hf = AutoTokenizer.from_pretrained(out)
    for k, v in spec["tokens"].items():
        assert hf.special_tokens_map.get(k) == v, (name, k, hf.special_tokens_map)
    return hf


def labels_for(model, hf, text, ids, messages):
    """Labels keeping the tokens that overlap each assistant turn's expected text."""
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    spans, pos, turns = [], 0, []
    for m in messages:
        if m["role"] != "assistant":
            continue
        want = expected_turn(model, m)
        at = text.index(want, pos)
        spans.append((at, at + len(want)))
        turns.append(want)
        pos = at + len(want)
    labels = [i if any(s < e2 and e > s2 for (s2, e2) in spans) else -100
              for i, (s, e) in zip(ids, enc["offset_mapping"])]
    return labels, turns


def render(hf, messages, tools, agp, kwargs):
    try:
        text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=agp,
                                      tokenize=False, **kwargs)
    except jinja2.exceptions.TemplateError as e:
        return None, str(e)
    ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=agp,
                                 tokenize=True, return_dict=True, **kwargs)["input_ids"]
    return (text, ids), None


def main():
    goldens = {
        "made_by": "crates/data/tests/chat/make_goldens.py",
        "versions": {"transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "jinja2": jinja2.__version__},
        "models": {},
    }
    for name, spec in MODELS.items():
        hf = build_model(name, spec)
        cases = []
        case_list = list(CASES)
        if name == "llama-3.2":
            # No date_string: the template calls strftime_now("%d %b %Y").
            case_list.append(("today", SINGLE, None, False, None))
        for case, messages, tools, agp, only in case_list:
            if only is not None and name not in only:
                continue
            kwargs = {}
            if name == "llama-3.2" and case != "today":
                kwargs["date_string"] = PINNED_DATE
            row = {"messages": messages}
            if tools is not None:
                row["tools"] = tools
            c = {"name": case, "row": json.dumps(row, ensure_ascii=False),
                 "add_generation_prompt": agp, "vars": kwargs}
            out, err = render(hf, messages, tools, agp, kwargs)
            if err is not None:
                c["error"] = err
            else:
                text, ids = out
                if case == "today":
                    today = time.strftime("%d %b %Y")
                    assert text.count(today) == 1
                    text = text.replace(today, "{TODAY}")
                c["text"] = text
                c["input_ids"] = ids
                if not agp and case != "today":
                    if name == "mistral-nemo" and case == "system_multi":
                        # The system prompt moves into the last user turn, so the render of the
                        # first turns is not a prefix of the whole: no mask can be read from it.
                        c["mask_error"] = "not prefix-stable"
                    else:
                        c["labels"], c["trained_turns"] = labels_for(name, hf, text, ids, messages)
            cases.append(c)
        goldens["models"][name] = {
            "dir": f"models/{name}",
            "template": f"templates/{spec['template']}",
            "cases": cases,
        }
    (HERE / "goldens.json").write_text(dump(goldens) + "\n")


def dump(v, level=0):
    """Indented JSON with lists of numbers on one line (ids and labels stay readable)."""
    pad = " " * (level + 1)
    if isinstance(v, dict) and v:
        items = [pad + json.dumps(k) + ": " + dump(x, level + 1) for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    if isinstance(v, list) and v and not all(isinstance(x, int) for x in v):
        return "[\n" + ",\n".join(pad + dump(x, level + 1) for x in v) + "\n" + " " * level + "]"
    return json.dumps(v, ensure_ascii=False)


if __name__ == "__main__":
    main()
