"""The shipped chat SFT set: short questions with checkable answers, sized for k3-mini (byte-level, 36M) plus LoRA.

    .venv/bin/python experiments/sft/make_chat_data.py          # rewrites chat_train.jsonl and chat_heldout.jsonl

Four tasks, each one user question and a one-line assistant answer of at most 12 characters: uppercase a lowercase
word, reverse a word, repeat a word twice (space-separated), add two whole numbers below 50. Each is asked in one of
a few phrasings, and about a third of the conversations open with a short system message. Every record is
``{"messages": [...], "answer": "<the assistant's exact text>", "task": "upper"}``; ``answer`` is for exact-match
scoring, ``task`` for per-task accuracy (readers of chat JSONL ignore keys other than ``messages``).

Held-out items are disjoint from training items: a (task, word) or (a, b) pair held out never appears in training
under any phrasing, so held-out accuracy measures the skill, not recall. Training conversations are drawn from the
remaining items with replacement. Deterministic: numpy's PCG64 seeded by ``--seed``; no downloads.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

# Common English words (3-8 lowercase letters), many of them also found in Python source and docstrings.
WORDS = """
able acid age air apple arm art baby back bad bag ball band bank base bath bear beat bed beef bell belt best
bird bit black blade blue boat body bone book boot bottle bowl box brain bread brick bridge brown brush bug
cake call calm camp card care cart case cash cat chain chair chalk cheese chest child city class clock cloud
coat code coin cold color cook copy corn cotton cow crowd cup curve cycle dance dark date day deep desk dog
door dream dress drink drop dust ear earth edge egg engine error event eye face fact farm field file fire
fish flag flame floor flower fog fold food foot fork frame frog fruit game garden gate gift girl glass glove
goat gold grain grape grass green ground group guide hair hammer hand hat head heart heat hill hole home hook
horn horse hour house ice idea ink iron island jam jelly jewel judge juice key kettle king kite knee knife
knot lake lamp land leaf leg lemon letter level lid light lily line lion list lock loop lunch map mark market
match meal meat milk mind mint money monkey moon morning mother mouse mouth music nail name neck needle nest
net night noise nose note number nut ocean office oil onion orange oven owl page paint paper park party
path pen pencil pepper piano pig pin pipe plane plant plate pocket point pool potato print queue quiet rabbit
rain river road rock roof room root rope rose salt sand scale school screen sea seed shape sheep shelf shell
ship shirt shoe silk silver sister skin sky sleep snake snow soap sock song soup space spoon spring stamp star
stem stick stone storm story street sugar summer sun table tail test thread thumb ticket tiger time toe token
tooth town toy train tree truck tube type value vessel voice wall watch water wave wheel whip wind window wing
winter wire wolf wood word world worm yarn year yellow zebra zone
""".split()
MAX_ANSWER = 12
SYSTEMS = ("Answer with the result only.", "You are a helpful assistant.", "Be brief.")
SYSTEM_FRAC = 1 / 3
PHRASINGS = {
    "upper": ("Uppercase: {w}", "Write {w} in capital letters.", "What is {w} in upper case?"),
    "reverse": ("Reverse: {w}", "Spell {w} backwards.", "What is {w} reversed?"),
    "repeat": ("Repeat twice: {w}", "Say {w} two times.", "Write {w} twice."),
    "add": ("{a} + {b} = ?", "What is {a} plus {b}?", "Add {a} and {b}."),
}
TASKS = tuple(PHRASINGS)
HERE = os.path.dirname(os.path.abspath(__file__))


def items(task: str) -> list[tuple]:
    """Every distinct operand of a task, in a fixed order: (word,) or (a, b)."""
    if task == "add":
        return [(a, b) for a in range(50) for b in range(50)]
    longest = MAX_ANSWER // 2 - 1 if task == "repeat" else MAX_ANSWER  # "word word" must fit
    return [(w,) for w in sorted(set(WORDS)) if len(w) <= longest]


def answer(task: str, item: tuple) -> str:
    if task == "add":
        return str(item[0] + item[1])
    w = item[0]
    return {"upper": w.upper(), "reverse": w[::-1], "repeat": f"{w} {w}"}[task]


def record(task: str, item: tuple, rng: np.random.Generator) -> dict:
    phrasing = PHRASINGS[task][rng.integers(len(PHRASINGS[task]))]
    question = phrasing.format(a=item[0], b=item[-1]) if task == "add" else phrasing.format(w=item[0])
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer(task, item)}]
    if rng.random() < SYSTEM_FRAC:
        messages.insert(0, {"role": "system", "content": SYSTEMS[rng.integers(len(SYSTEMS))]})
    return {"messages": messages, "answer": answer(task, item), "task": task}


def generate(seed: int = 0, n_train: int = 3000, n_heldout: int = 200) -> tuple[list[dict], list[dict]]:
    """(train, heldout) records. Steps:
    1. per task, shuffle its items and set aside n_heldout / 4 of them as held-out (tasks equally represented);
    2. held-out: one record per set-aside item; train: n_train records, task uniform, item uniform among the rest.
    """
    rng = np.random.default_rng(seed)
    per_task = n_heldout // len(TASKS)
    held_items, train_items = {}, {}
    for task in TASKS:
        pool = items(task)
        order = rng.permutation(len(pool))
        held_items[task] = [pool[j] for j in order[:per_task]]
        train_items[task] = [pool[j] for j in order[per_task:]]
    heldout = [record(task, item, rng) for task in TASKS for item in held_items[task]]
    heldout = [heldout[j] for j in rng.permutation(len(heldout))]
    train = []
    for _ in range(n_train):
        task = TASKS[rng.integers(len(TASKS))]
        train.append(record(task, train_items[task][rng.integers(len(train_items[task]))], rng))
    return train, heldout


def to_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=3000, help="training conversations")
    p.add_argument("--heldout", type=int, default=200, help="held-out conversations (a multiple of 4)")
    p.add_argument("--out", default=HERE, help="directory for chat_train.jsonl and chat_heldout.jsonl")
    args = p.parse_args(argv)
    train, heldout = generate(args.seed, args.train, args.heldout)
    for name, recs in (("chat_train.jsonl", train), ("chat_heldout.jsonl", heldout)):
        path = os.path.join(args.out, name)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(to_jsonl(recs))
        counts = {t: sum(r["task"] == t for r in recs) for t in TASKS}
        print(f"{path}: {len(recs)} conversations ({', '.join(f'{t} {c}' for t, c in counts.items())}), "
              f"{sum(len(r['messages']) == 3 for r in recs)} with a system message, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
