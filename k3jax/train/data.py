"""Training data: tokens, document boundaries and target weights, a held-out split, and batches that are a pure
function of (seed, step).

    train, heldout = split(load_corpus(None, max_bytes=CORPUS_BYTES), heldout_frac=HELDOUT_FRAC)
    x = batch_at(train, seed=0, step=17, batch=16, seq_len=128)   # [16, 129] int32; inputs x[:, :-1]

    corpus = load_documents(paths, tokenizer=tok, template=tpl)   # text, {"text"} or {"messages"}
    train, held = split_documents(corpus)                         # held out: the last HELDOUT_FRAC (0.05)
    b = packed_batch_at(train, seed=0, step=17, batch=16, seq_len=128)   # {"tokens", "segments", "weights"}

Because a batch depends only on (seed, step), a resumed run sees exactly the batches an uninterrupted run would
(the data position IS the step). Vocabularies smaller than 256 (k3-tiny: 97) see ``byte % vocab``. Windows of the
held-out split, and their loss, are ``k3jax.train.evaluate``'s.

Documents and packing (docs/model.md §4.7). Each text file, each ``{"text"}`` line and each ``{"messages"}``
conversation is one document. A ``Corpus`` keeps the token stream with every token's document index and whether it is a
target (chat: the assistant's tokens, ``k3jax.chat.encode_chat``; text: every token). ``packed_batch_at`` returns rows
of ``seq_len + 1`` tokens with ``segments`` (the document index per token, so KDA, the conv and MLA restart at each
boundary: ``k3jax.ops.segments``) and ``weights`` [b, seq_len] (1 where predicting token t + 1 counts: a target
in the same document as token t — never a document's first token from the one before). Text is cut into random
windows as ``batch_at`` cuts it (same tokens); chat conversations are packed whole into rows (``pack_rows``: in
file order, first come first packed, a row closed when the next conversation does not fit, padding its own
document with weight 0; a conversation longer than a row is cut into row-sized pieces), and rows are drawn by a
per-epoch permutation. ``stride_rows`` cuts a text stream into rows as `k3 tokenize` writes them.

Pre-tokenized shards (`k3 tokenize`, ``k3jax.train.shards``): when ``--data`` is one directory holding a
manifest.json, ``prepare`` returns ``k3jax.train.stream.ShardData``, which has ``TrainData``'s interface and reads
each batch's rows from disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from k3jax.chat import encode_chat, jsonl_records, read_chat_jsonl, sniff_jsonl, template_for
from k3jax.data import stdlib_documents
from k3jax.errors import InputError
from k3jax.tokenizer import load_tokenizer
from k3jax.train.evaluate import Windows, spaced_windows
from k3jax.train.settings import CORPUS_BYTES, HELDOUT_FRAC
from k3jax.train.shards import BYTES_IDENTITY, entropy_of_counts, prediction_weights, tokenizer_identity
from k3jax.train.stream import ShardData, is_shard_dir, open_shards, read_manifest


def _text_documents(path: str) -> list[bytes]:
    """A text file as one document, a ``{"text"}`` JSONL file as one document a line."""
    if not os.path.isfile(path):
        raise InputError(f"--data: no such file {path!r}")
    if not path.endswith(".jsonl"):
        try:
            with open(path, "rb") as f:
                return [f.read()]
        except OSError as e:
            raise InputError(f"--data: cannot read {path!r}: {e}") from e
    out = []
    for n, rec in jsonl_records(path):
        if not isinstance(rec.get("text"), str):
            raise InputError(f"--data: {path}:{n}: each JSONL line needs a string field \"text\"")
        out.append(rec["text"].encode("utf-8"))
    return out


def load_corpus(paths=None, *, max_bytes: int = CORPUS_BYTES) -> np.ndarray:
    """uint8 tokens: the stdlib corpus (``paths`` None) or the concatenation of user text / ``{"text"}`` files, each
    joined to the next by a newline (``load_documents``' stream, without the document boundaries)."""
    return load_documents(paths, max_bytes=max_bytes).tokens


class Corpus(NamedTuple):
    tokens: np.ndarray  # [N] token ids (uint8 for bytes, int32 otherwise)
    doc: np.ndarray  # [N] int32 document index, non-decreasing
    target: np.ndarray | None  # [N] bool: the token is one to learn (None: every token)
    chat: bool = False  # documents are conversations: packed whole into rows


def _is_chat(path: str) -> bool:
    return path.endswith(".jsonl") and os.path.isfile(path) and sniff_jsonl(path) == "messages"


def load_documents(paths=None, *, max_bytes: int = CORPUS_BYTES, tokenizer=None, template=None) -> Corpus:
    """The corpus as documents: the stdlib one file a document (``paths`` None), text files / ``{"text"}`` lines,
    or ``{"messages"}`` conversations rendered by ``template`` and tokenized by ``tokenizer``
    (``k3jax.chat.encode_chat``; both needed for chat data). Text and chat files cannot be mixed. Text tokens are
    exactly ``load_corpus``'s (the joining newlines end the document before them); at most ``max_bytes`` text
    bytes (chat: whole conversations until the first one past ``max_bytes`` tokens)."""
    paths = [os.fspath(p) for p in (paths or ())]
    kinds = {p: _is_chat(p) for p in paths}
    if paths and any(kinds.values()):
        if not all(kinds.values()):
            chat, text = (", ".join(p for p in paths if kinds[p] == k) for k in (True, False))
            raise InputError(f"--data: chat ({{\"messages\"}}) and text files cannot be mixed: {chat} vs {text}")
        return _chat_corpus(paths, max_bytes, tokenizer, template)
    if not paths:
        docs = stdlib_documents(max_bytes)
    else:
        docs = [d for p in paths for d in _text_documents(p)]
        docs = [d + b"\n" for d in docs[:-1]] + docs[-1:]
    sizes, n = [], 0
    for d in docs:
        sizes.append(min(len(d), max_bytes - n))
        n += sizes[-1]
        if n >= max_bytes:
            break
    toks = np.frombuffer(b"".join(d[:k] for d, k in zip(docs, sizes)), np.uint8).copy()
    if toks.size == 0:
        raise InputError("--data: the corpus is empty")
    return Corpus(toks, np.repeat(np.arange(len(sizes), dtype=np.int32), sizes), None)


def _chat_corpus(paths, max_tokens: int, tokenizer, template) -> Corpus:
    if tokenizer is None or template is None:
        raise InputError("--data: chat data needs the model's tokenizer and chat template")
    ids, tgt, n = [], [], 0
    for path in paths:
        for i, messages in enumerate(read_chat_jsonl(path)):
            a, t = encode_chat(messages, template, tokenizer, source=f"{path}: conversation {i + 1}")
            ids.append(a)
            tgt.append(t)
            n += a.size
            if n >= max_tokens:
                break
        if n >= max_tokens:  # the limit ends the corpus, not only this file
            break
    if not ids:
        raise InputError(f"--data: no conversations in {', '.join(paths)}")
    return Corpus(np.concatenate(ids).astype(np.int32), np.repeat(np.arange(len(ids), dtype=np.int32),
                  [a.size for a in ids]), np.concatenate(tgt), chat=True)


def split_documents(corpus: Corpus, heldout_frac: float = HELDOUT_FRAC) -> tuple[Corpus, Corpus]:
    """(train, heldout): text as ``split`` (the tail of the stream, the same tokens), chat at the document boundary
    nearest the fraction (at least one conversation on each side)."""
    N = corpus.tokens.size
    cut = N - int(N * heldout_frac)
    if corpus.chat:
        starts = np.flatnonzero(np.diff(corpus.doc, prepend=-1))
        if starts.size < 2:
            raise InputError("--data: a held-out split needs at least two conversations")
        cut = int(starts[np.clip(np.searchsorted(starts, cut), 1, starts.size - 1)])

    def part(sl):
        return Corpus(corpus.tokens[sl], corpus.doc[sl], None if corpus.target is None else corpus.target[sl],
                      corpus.chat)

    return part(slice(0, cut)), part(slice(cut, N))


def pack_rows(corpus: Corpus, seq_len: int) -> dict:
    """Whole documents packed into rows of ``seq_len + 1`` tokens (module docstring): {"tokens", "segments"
    [R, seq_len + 1] int32, "weights" [R, seq_len] float32, "cut": documents longer than a row}."""
    L = seq_len + 1
    starts = np.flatnonzero(np.diff(corpus.doc, prepend=-1))
    bounds = list(zip(starts, [*starts[1:], corpus.tokens.size], strict=True))
    pieces = [(a + i, min(a + i + L, e)) for a, e in bounds for i in range(0, e - a, L)]
    rows, row, used = [], [], 0
    for a, e in pieces:
        if used + e - a > L:
            rows.append(row)
            row, used = [], 0
        row.append((a, e))
        used += e - a
    rows.append(row)
    tok = np.zeros((len(rows), L), np.int32)
    seg = np.full((len(rows), L), -1, np.int32)
    tgt = np.zeros((len(rows), L), bool)
    for r, row in enumerate(rows):
        at = 0
        for i, (a, e) in enumerate(row):
            tok[r, at:at + e - a], seg[r, at:at + e - a] = corpus.tokens[a:e], i
            tgt[r, at:at + e - a] = True if corpus.target is None else corpus.target[a:e]
            at += e - a
    return {"tokens": tok, "segments": seg, "weights": prediction_weights(seg, tgt),
            "cut": sum(1 for a, e in bounds if e - a > L)}


def stride_rows(corpus: Corpus, seq_len: int) -> dict:
    """A text stream cut at stride ``seq_len`` (`k3 tokenize`'s text rows, in memory): row r is tokens
    ``[r T, r T + T + 1)``, so every next-token prediction lies in exactly one row; the last row is right-padded
    (tokens 0, segment -1, weight 0). {"tokens", "segments" (document index relative to the row's first token's)
    [R, seq_len + 1] int32, "weights" [R, seq_len] float32}."""
    T, N = seq_len, corpus.tokens.size
    R = max(-(-(N - 1) // T), 0)
    idx = np.arange(R)[:, None] * T + np.arange(T + 1)[None, :]
    real = idx < N
    idx = np.minimum(idx, N - 1)
    tok = np.where(real, corpus.tokens[idx], 0).astype(np.int32)
    seg = np.where(real, corpus.doc[idx] - corpus.doc[idx[:, :1]], -1).astype(np.int32)
    tgt = real if corpus.target is None else real & corpus.target[idx]
    return {"tokens": tok, "segments": seg, "weights": prediction_weights(seg, tgt)}


def packed_batch_at(corpus: Corpus, *, seed: int, step: int, batch: int, seq_len: int, vocab: int = 256,
                    rows: dict | None = None) -> dict:
    """{"tokens", "segments" [batch, seq_len + 1] int32, "weights" [batch, seq_len] float32} of step ``step``.
    Text: ``batch_at``'s windows (the same tokens) with their document ids; chat: ``rows`` (``pack_rows``, built
    once by the caller) drawn by a permutation per epoch seeded by (seed, epoch)."""
    if rows is None:
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(corpus.tokens) - seq_len - 1, size=batch)
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        tok, seg = corpus.tokens[idx].astype(np.int32), corpus.doc[idx]
        w = prediction_weights(seg, None if corpus.target is None else corpus.target[idx])
    else:
        R = rows["tokens"].shape[0]
        i = step * batch + np.arange(batch)
        pick = np.empty(batch, np.int64)
        for e in np.unique(i // R):
            sel = i // R == e
            pick[sel] = np.random.default_rng([seed, int(e)]).permutation(R)[i[sel] % R]
        tok, seg, w = rows["tokens"][pick], rows["segments"][pick], rows["weights"][pick]
    return {"tokens": tok % vocab if vocab < 256 else tok, "segments": seg, "weights": w}


@dataclass
class TrainData:
    """A run's data (``prepare``): the training batches as a function of (seed, step) and the fixed eval set."""

    train: Corpus
    eval_set: Any  # k3jax.train.evaluate.Windows
    held_entropy: float
    vocab: int  # ids are taken % vocab below 256 (byte data on a smaller vocabulary)
    packing: bool  # packed batches (segments + weights) rather than plain token windows
    rows: dict | None = None  # chat: the packed rows (``pack_rows``)

    @property
    def train_toks(self) -> np.ndarray:
        return self.train.tokens

    def batch(self, *, seed: int, step: int, batch: int, seq_len: int, rows=None):
        """Step ``step``'s batch: tokens [batch, seq_len + 1] (``batch_at``), or a packed batch; ``rows``: only these
        rows of it (global row indices in [0, batch); None: all), as a process of a multi-process run asks."""
        if not self.packing:
            out = batch_at(self.train.tokens, seed=seed, step=step, batch=batch, seq_len=seq_len, vocab=self.vocab)
        else:
            out = packed_batch_at(self.train, seed=seed, step=step, batch=batch, seq_len=seq_len, vocab=self.vocab,
                                  rows=self.rows)
        if rows is None:
            return out
        rows = np.asarray(rows, np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= batch):
            raise ValueError(f"rows must lie in [0, {batch}), got {rows.min()}..{rows.max()}")
        return out[rows] if isinstance(out, np.ndarray) else {k: v[rows] for k, v in out.items()}


def prepare(tc, cfg, n_dev: int, log) -> TrainData | ShardData:
    """The corpus of ``tc.data`` split, checked and set up for ``tc.seq_len``: text with document masks
    (``tc.packing_masks``) or as plain windows (today's batches, exactly), chat packed into rows (with
    ``--no-packing-masks`` every row is one sequence to the mixers; the assistant-only weights stay). One shard
    directory (`k3 tokenize`): ``prepare_shards``."""
    vocab = min(cfg.vocab_size, 256)
    if cfg.vocab_size < 256:
        log(f"vocab {cfg.vocab_size} < 256: tokens are byte % {cfg.vocab_size}")
    n_eval = max(n_dev, tc.eval_windows // n_dev * n_dev)   # rounded down to the devices, at least one each
    if is_shard_dir(tc.data):
        return prepare_shards(tc, cfg, n_eval, log)
    chat = any(_is_chat(os.fspath(p)) for p in tc.data)
    tok = tpl = None
    if chat:
        tok = load_tokenizer(tc.init, max(cfg.vocab_size, 256))
        tpl = template_for(tc.init, tok)
    corpus = load_documents(tc.data, max_bytes=tc.max_bytes, tokenizer=tok, template=tpl)
    train, held = split_documents(corpus, tc.heldout_frac)
    if not chat:
        check_size(train.tokens, tc.seq_len, "training")
        check_size(held.tokens, tc.seq_len, "held-out")
        ev = spaced_windows(held.tokens, num=n_eval, seq_len=tc.seq_len, vocab=vocab)
        if tc.packing_masks:
            at = np.linspace(0, len(held.tokens) - tc.seq_len - 1, n_eval).astype(np.int64)
            seg = held.doc[at[:, None] + np.arange(tc.seq_len + 1)[None, :]]
            ev = Windows(ev.tokens, prediction_weights(seg, None), seg)
        return TrainData(train, ev, unigram_entropy(held.tokens, vocab), vocab, tc.packing_masks)
    rows, held_rows = pack_rows(train, tc.seq_len), pack_rows(held, tc.seq_len)
    if rows["cut"] or held_rows["cut"]:
        log(f"{rows['cut'] + held_rows['cut']} conversations longer than --seq-len + 1 = {tc.seq_len + 1} tokens "
            "were cut into pieces")
    for r in (rows, held_rows):
        r["tokens"] = r["tokens"] % vocab if vocab < 256 else r["tokens"]
        if not tc.packing_masks:
            r["segments"] = np.zeros_like(r["segments"])
    log(f"chat data: {int(train.doc[-1] - train.doc[0]) + 1} conversations in {rows['tokens'].shape[0]} packed rows "
        f"of {tc.seq_len + 1} tokens for training, {held_rows['tokens'].shape[0]} held out; "
        f"{float(rows['weights'].mean()):.1%} of predictions are assistant tokens")
    ev = Windows(held_rows["tokens"][:n_eval], held_rows["weights"][:n_eval], held_rows["segments"][:n_eval])
    return TrainData(train, ev, unigram_entropy(held.tokens, vocab), vocab, True, rows)


def prepare_shards(tc, cfg, n_eval: int, log) -> ShardData:
    """``tc.data``'s one shard directory opened for this model (``stream.open_shards``): chat shards must have been
    made with the model's tokenizer and chat template (``tc.init``'s, else bytes and the built-in template); text
    shards are bytes, as in-memory text is. The split and the corpus size were fixed by `k3 tokenize`."""
    root = os.fspath(tc.data[0])
    manifest, _ = read_manifest(root)
    ident, tpl = dict(BYTES_IDENTITY), None
    if manifest["kind"] == "chat":
        tok = load_tokenizer(tc.init, max(cfg.vocab_size, 256))
        ident, tpl = tokenizer_identity(tok, tc.init), template_for(tc.init, tok)
    data = open_shards(root, seq_len=tc.seq_len, tokenizer_identity=ident, template=tpl, vocab=min(cfg.vocab_size,
                       256), packing_masks=tc.packing_masks, n_eval=n_eval)
    sp = manifest["splits"]
    log(f"{manifest['kind']} shards {root}: {sp['train']['rows']} training rows of {tc.seq_len + 1} tokens "
        f"({sp['train']['tokens']:,} tokens), {sp['heldout']['rows']} held out; the split was fixed by `k3 tokenize` "
        f"(held-out fraction {manifest['heldout_frac']}, max bytes {manifest['max_bytes']}): --max-bytes and "
        "--heldout-frac are not read")
    return data


def split(tokens: np.ndarray, heldout_frac: float = HELDOUT_FRAC) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout): the held-out part is the corpus tail, so no training window overlaps it."""
    n_held = int(len(tokens) * heldout_frac)
    return tokens[: len(tokens) - n_held], tokens[len(tokens) - n_held:]


def check_size(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if len(tokens) < seq_len + 2:
        raise InputError(f"--data: the {what} split has {len(tokens)} bytes, fewer than seq_len + 2 = {seq_len + 2}")


def batch_at(tokens: np.ndarray, *, seed: int, step: int, batch: int, seq_len: int, vocab: int = 256) -> np.ndarray:
    """[batch, seq_len + 1] int32 windows at positions drawn from numpy's PCG64 seeded by (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    x = tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    return x % vocab if vocab < 256 else x


def unigram_entropy(tokens: np.ndarray, vocab: int = 256) -> float:
    """Unigram (byte-frequency) entropy in nats: the loss of the best context-free predictor."""
    return entropy_of_counts(np.bincount(np.asarray(tokens).reshape(-1).astype(np.int64)), vocab)


__all__ = ["Corpus", "TrainData", "batch_at", "check_size", "load_corpus", "load_documents", "pack_rows",
           "packed_batch_at", "prediction_weights", "prepare", "prepare_shards", "split", "split_documents",
           "stride_rows", "unigram_entropy"]
