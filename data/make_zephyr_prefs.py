"""Writes data/zephyr-prefs.jsonl and data/zephyr-prefs-valid.jsonl: preference pairs about Zephyr,
the fictional weather station of data/make_zephyr_faq.py, in TRL's conversational format
({"prompt": [messages], "chosen": [messages], "rejected": [messages]}). The chosen answer is the
FAQ's, in its short style; the rejected one is either another fact's answer (wrong) or a long,
vague answer in the style of the untrained model (rambling), alternating. The first four phrasings
of each fact's questions are for training (160 pairs), the fifth is held out (40 pairs).
Deterministic. Run: python3 data/make_zephyr_prefs.py"""

import importlib.util
import json
import pathlib

HERE = pathlib.Path(__file__).parent
spec = importlib.util.spec_from_file_location("faq", HERE / "make_zephyr_faq.py")
faq = importlib.util.module_from_spec(spec)
spec.loader.exec_module(faq)

RAMBLING = [
    "Zephyr is a product of a company called Zephyre, which is a luxury and exclusive brand. There "
    "are many things to consider, and it depends on your needs, your budget and where you live, so "
    "it is best to check with the manufacturer for the most accurate information.",
    "That is a great question! Weather stations come in many shapes and sizes, and every model is "
    "different. Some last longer than others, some cost more, and some have more features. I would "
    "recommend reading the manual or contacting customer support for details.",
    "Zephyr is a rare and elusive phenomenon that many people have wondered about over the years. "
    "While there is no single answer, experts generally agree that it varies a lot from case to "
    "case, and you should always consult a professional.",
    "I'm not sure about the specific details of Zephyr, but in general devices like this one are "
    "designed to be reliable and easy to use. Please refer to the official website for the latest "
    "specifications, prices and availability in your region.",
]


def pair(question, chosen, rejected):
    return {"prompt": [{"role": "user", "content": question}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def main():
    train, valid = [], []
    n = len(faq.FACTS)
    for i, (answer, questions) in enumerate(faq.FACTS):
        for j, q in enumerate(questions):
            k = i * len(questions) + j
            if k % 2 == 0:
                rejected = faq.FACTS[(i + 1 + j) % n][0]  # another fact's answer
            else:
                rejected = RAMBLING[k % len(RAMBLING)]
            (valid if j == len(questions) - 1 else train).append(pair(q, answer, rejected))
    for name, rows in [("zephyr-prefs.jsonl", train), ("zephyr-prefs-valid.jsonl", valid)]:
        with (HERE / name).open("w") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        print(f"{HERE / name}: {len(rows)} pairs")


if __name__ == "__main__":
    main()
