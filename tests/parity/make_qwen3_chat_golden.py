#!/usr/bin/env python3
"""Qwen3 chat masks made by transformers itself, for crates/data/tests/qwen3_chat.rs.

Qwen3's chat template rewrites earlier assistant turns (it drops the `<think>` reasoning of every
assistant turn before the last user query, and shows it, or an empty think block, for the turns
after it), so the render of a conversation's first turns is not a prefix of the whole render. This
renders multi-turn conversations with reasoning through `tokenizer.apply_chat_template` with the
real Qwen/Qwen3-0.6B template (tests/fixtures/qwen3-chat/qwen3-0.6b.jinja, see NOTICE.md there),
with `enable_thinking` unset, true and false, and writes what rtune must reproduce:
- the text (`tokenize=False`) and the ids (`tokenize=True`);
- the expected loss mask, found in the final render without rtune's algorithm: every
  `<|im_start|>assistant\n` ... first `<|im_end|>` after it is one assistant turn, trained from
  just after the header through `<|im_end|>` (the `\n` after it is not trained). Where the final
  render shows the whole generation prompt there (with enable_thinking=false, the empty think block
  `<think>\n\n</think>\n\n` of the last turn), that prompt is not trained either, as for every other
  template: the model is given it at inference. `spans` are byte ranges of the UTF-8 text, `labels`
  keep the ids of the tokens that overlap a span (as transformers' `assistant_masks` does).

The tokenizer (tests/fixtures/qwen3-chat/tokenizer.json) is tiny-llama's byte-level BPE plus
Qwen3's special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) and its added non-special
tokens (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`), no BOS, as Qwen3's. Run from the repository root with the reference venv
(transformers 5.24.0, tokenizers 0.23.3, jinja2 3.1.6):
    /work/venv-ref/bin/python tests/parity/make_qwen3_chat_golden.py
Reruns are byte-identical.
"""

import json
from pathlib import Path

import jinja2
import tokenizers
import transformers
from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests/fixtures/qwen3-chat"
BASE = ROOT / "tests/fixtures/tiny-llama/tokenizer.json"
TEMPLATE = OUT / "qwen3-0.6b.jinja"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
         "</think>"]
HEADER = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
EOT = "<|im_end|>"


def u(c):
    return {"role": "user", "content": c}


def a(c, r=None, key="reasoning_content"):
    m = {"role": "assistant", "content": c}
    if r is not None:
        m[key] = r
    return m


TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS = {
    # reasoning_content on every assistant turn: the first loses it in the final render.
    "two_turns_reasoning": [
        {"role": "system", "content": "You are terse."},
        u("What is 2+2?"), a("4.", "2 plus 2 is 4."),
        u("And 3+3?"), a("6.", "3 plus 3 is 6."),
    ],
    # Reasoning inline in the content, as `<think>...</think>`: the template splits it off.
    "three_turns_inline_think": [
        u("Hi"), a("<think>\nA greeting.\n</think>\n\nHello!"),
        u("Name a colour."), a("<think>\nAny will do.\n</think>\n\nBlue."),
        u("Another?"), a("<think>\nNot blue.\n</think>\n\nRed."),
    ],
    # Mixed: no reasoning, then reasoning, then a last turn without (an empty think block).
    "mixed_reasoning": [
        u("One?"), a("1"),
        u("Two?"), a("2", "Count on."),
        u("Three? ünï 😀"), a("  3 — ok.\n"),
    ],
    # A tool round after the last query keeps its reasoning; the `reasoning` alias is used.
    "tool_round_reasoning": [
        u("Weather in Paris?"),
        {"role": "assistant", "content": "", "reasoning": "I should call the tool.",
         "tool_calls": [CALL]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        a("It is 21 °C.", "The tool says 21.", key="reasoning"),
    ],
    # An earlier tool round, then a new query: the earlier turns lose their reasoning.
    "tool_round_then_query": [
        u("Weather in Paris?"),
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Call it.",
         "tool_calls": [CALL]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        a("21 °C.", "Read the result."),
        u("Thanks!"), a("You're welcome.", "Be polite."),
    ],
    # One turn: prefix-stable, here as a control.
    "single_reasoning": [u("Why?"), a("Because.", "Short answer.")],
}
# enable_thinking: None = not passed to the template.
THINKING = [None, True, False]


def build_tokenizer():
    tok = Tokenizer.from_file(str(BASE))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    j = json.loads(tok.to_str())
    j["post_processor"] = None
    (OUT / "tokenizer.json").write_text(json.dumps(j, ensure_ascii=False, indent=1) + "\n")
    cfg = dict(bos_token=None, eos_token=EOT, pad_token="<|endoftext|>", unk_token=None,
               add_bos_token=False, tokenizer_class="PreTrainedTokenizerFast",
               clean_up_tokenization_spaces=False, model_max_length=4096,
               chat_template=TEMPLATE.read_text())
    (OUT / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1)
                                               + "\n")
    hf = AutoTokenizer.from_pretrained(OUT)
    assert hf.chat_template == TEMPLATE.read_text()
    return hf


def expected_spans(text, thinking):
    """Character spans of the assistant turns, found in the final render."""
    spans, pos = [], 0
    while (at := text.find(HEADER, pos)) >= 0:
        start = at + len(HEADER)
        end = text.index(EOT, start) + len(EOT)
        if thinking is False and text.startswith(EMPTY_THINK, start):
            start += len(EMPTY_THINK)
        spans.append((start, end))
        pos = end
    return spans


def main():
    hf = build_tokenizer()
    cases = []
    for name, messages in CONVERSATIONS.items():
        tools = TOOLS if any(m["role"] == "tool" for m in messages) else None
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        for thinking in THINKING:
            kwargs = {} if thinking is None else {"enable_thinking": thinking}
            text = hf.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
            ids = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                         **kwargs)["input_ids"]
            enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
            assert enc["input_ids"] == ids
            spans = expected_spans(text, thinking)
            assert len(spans) == n_assistant, (name, thinking, spans)
            labels = [i if any(s < e2 and e > s2 for (s2, e2) in spans) else -100
                      for i, (s, e) in zip(ids, enc["offset_mapping"])]
            byte = lambda c: len(text[:c].encode())  # noqa: E731
            row = {"messages": messages}
            if tools is not None:
                row["tools"] = tools
            cases.append({
                "name": name,
                "enable_thinking": thinking,
                "row": json.dumps(row, ensure_ascii=False),
                "text": text,
                "spans": [[byte(s), byte(e)] for s, e in spans],
                "trained_turns": [text[s:e] for s, e in spans],
                "input_ids": ids,
                "labels": labels,
            })
    golden = {
        "made_by": "tests/parity/make_qwen3_chat_golden.py",
        "template": "qwen3-0.6b.jinja",
        "versions": {"transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "jinja2": jinja2.__version__},
        "cases": cases,
    }
    (OUT / "golden.json").write_text(dump(golden) + "\n")


def dump(v, level=0):
    """Indented JSON with lists of numbers on one line."""
    pad = " " * (level + 1)
    if isinstance(v, dict) and v:
        items = [pad + json.dumps(k) + ": " + dump(x, level + 1) for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    if isinstance(v, list) and v and not all(isinstance(x, int) for x in v):
        return "[\n" + ",\n".join(pad + dump(x, level + 1) for x in v) + "\n" + " " * level + "]"
    return json.dumps(v, ensure_ascii=False)


if __name__ == "__main__":
    main()
