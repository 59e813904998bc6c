"""Scoring a model on chat data with checkable answers (the shipped SFT set, experiments/sft/): the loss on the
assistant's tokens and the exact match of greedy answers.

    nats, n = answer_loss(params, cfg, run, "experiments/sft/chat_heldout.jsonl")      # mean nats per answer token
    acc = exact_match(params, cfg, run, "experiments/sft/chat_heldout.jsonl")          # {"all": 0.8, "add": ...}

``answer_loss`` packs the conversations into rows (``k3jax.train.data.pack_rows``: whole conversations, each mixed
on its own) and averages the cross-entropy of the assistant's tokens — its content and closing marker, as
``k3jax.chat.encode_chat`` marks them. ``exact_match`` renders each conversation up to its last assistant turn with
the generation prompt, decodes greedily until the template's turn end (or ``max_new_tokens``) and compares the text
before the end marker with the record's ``answer``.
"""

from __future__ import annotations

import json

import numpy as np

from k3jax.chat import BUILTIN_TEMPLATE, read_chat_jsonl, render, template_for
from k3jax.model.generate import generate
from k3jax.tokenizer import ByteTokenizer
from k3jax.train import data as tdata
from k3jax.train.evaluate import Windows, heldout_loss, make_scorer

END = "<|end|>"  # BUILTIN_TEMPLATE's turn end


def _template(ckpt, tok):
    return BUILTIN_TEMPLATE if ckpt is None else template_for(ckpt, tok)


def answer_loss(params, cfg, run, path: str, *, seq_len: int = 256, batch: int = 16, ckpt: str | None = None):
    """(mean nats per assistant token, tokens scored) over the conversations of ``path``."""
    tok = ByteTokenizer(max(cfg.vocab_size, 256))
    corpus = tdata.load_documents([path], max_bytes=1 << 40, tokenizer=tok, template=_template(ckpt, tok))
    rows = tdata.pack_rows(corpus, seq_len)
    tokens = rows["tokens"] % cfg.vocab_size if cfg.vocab_size < 256 else rows["tokens"]   # as training sees bytes
    w = Windows(tokens, rows["weights"], rows["segments"])
    return heldout_loss(params, w, batch=batch, score=make_scorer(cfg, run))


def exact_match(params, cfg, run, path: str, *, max_new_tokens: int = 24, batch: int = 50,
                ckpt: str | None = None) -> dict:
    """Greedy answers vs each record's ``answer``: {"all": fraction right, <task>: fraction, "n": records,
    "samples": the first few (answer, reply) pairs}."""
    tok = ByteTokenizer(max(cfg.vocab_size, 256))
    template = _template(ckpt, tok)
    records = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    convs = read_chat_jsonl(path)
    prompts, answers, tasks = [], [], []
    for rec, msgs in zip(records, convs, strict=True):
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        prompts.append(tok.encode(render(msgs[:last], template, add_generation_prompt=True)))
        answers.append(rec.get("answer", msgs[last]["content"]))
        tasks.append(rec.get("task", "all"))
    replies = []
    stop = tok.encode("\n")
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        arr = np.full((len(chunk), max(map(len, chunk))), -1, np.int32)
        for j, p in enumerate(chunk):
            arr[j, :len(p)] = p
        out = generate(params, arr, cfg, run, max_new_tokens=max_new_tokens, stop=stop)
        for row in out.tokens:
            replies.append(tok.decode([int(t) for t in row if t >= 0]).split(END)[0])
    right = np.array([r == a for r, a in zip(replies, answers, strict=True)])
    out = {"all": float(right.mean()), "n": len(right),
           "samples": [(a, r) for a, r in zip(answers[:6], replies[:6], strict=True)]}
    for t in sorted(set(tasks)):
        sel = np.array([x == t for x in tasks])
        out[t] = float(right[sel].mean())
    return out


__all__ = ["answer_loss", "exact_match"]
