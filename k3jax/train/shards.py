"""Pre-tokenized training data on disk (`k3 tokenize`; read back by ``k3jax.train.stream``): the rows a run trains
on, written once as ArrayRecord shards with a manifest, so that each process of a run reads only its rows.

    m = write_shards(["a.jsonl"], "shards/", seq_len=128, tokenizer=tok, template=tpl)   # the manifest (a dict)

The rows are ``k3jax.train.data``'s for the same files — ``load_documents``' documents, ``split_documents``' held-out
split, then ``pack_rows`` (chat) or ``stride_rows`` (text: the stream cut at stride ``seq_len``, so every next-token
prediction lies in exactly one row) — computed without holding the corpus: sources are read file by file and line
by line and rows written as they fill. The split needs the corpus size before the first row, so a first pass
measures it (text: file sizes, ``{"text"}`` lines parsed; chat: each conversation tokenized once into a spill file
that the second pass reads back).

A row is ``seq_len + 1`` tokens: tokens int32 [L], segments int32 [L] (document index relative to the row's first
document; padding -1) and weights float32 [L - 1] (``prediction_weights``); one ArrayRecord record holds one row as
the three arrays' little-endian bytes back to back (``encode_rows``; no pickle). Token ids are the tokenizer's own
(a vocabulary under 256 takes ``% vocab`` when read). Files: ``{train,heldout}-0000i-of-0000N.array_record`` and
``manifest.json`` (``write_shards``), written in a temporary sibling renamed into place (``staged_dir``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from k3jax.chat import check_messages, encode_chat, jsonl_records
from k3jax.checkpoint.atomic import staged_dir
from k3jax.checkpoint.container import sha256_file
from k3jax.errors import InputError
from k3jax.tokenizer import RANKS_FILE
from k3jax.train.settings import HELDOUT_FRAC

FORMAT, VERSION, MANIFEST = "k3jax-shards", 1, "manifest.json"
ROWS_PER_FILE = 1 << 16  # ~37 MB a file for 128-token text rows
# group_size 16, not grain's 1: a reader holds an index entry per group; at 1 a reading process's peak RSS grew 105 MB
# from 0.2 to 2 GB of text (experiments/stream_memory.py), at 16 by 8 MB. A row read decompresses its group (~25 kB).
WRITER_OPTIONS = "group_size:16,snappy"
BYTES_IDENTITY = {"kind": "bytes"}
_CHUNK = 4 << 20  # bytes of a text file read at once; rows are cut per chunk


def prediction_weights(seg: np.ndarray, tgt: np.ndarray | None) -> np.ndarray:
    """[..., L] document ids and target flags (None: every token) → [..., L - 1] float32: predicting token t + 1
    counts when it is a target in the same document as token t (never a document's first token from the one
    before). The one rule of every batch, in memory (``k3jax.train.data``) and on disk."""
    w = seg[..., 1:] == seg[..., :-1]
    if tgt is not None:
        w = w & tgt[..., 1:]
    return w.astype(np.float32)


def entropy_of_counts(counts: np.ndarray, vocab: int = 256) -> float:
    """Unigram entropy (nats) of token counts (``counts[i]``: how often id i occurs); ids ``% vocab`` below 256."""
    c = np.asarray(counts, np.float64)
    if vocab < 256:
        c = np.bincount(np.arange(c.size) % vocab, weights=c, minlength=vocab)
    p = c[c > 0] / c.sum()
    return float(-(p * np.log(p)).sum())


def tokenizer_identity(tokenizer, path: str | None = None) -> dict:
    """What the token ids depend on: bytes, or the Kimi BPE of checkpoint ``path`` (sha256 of its ranks file
    ``tiktoken.model`` and of its special tokens and split pattern, and the vocabulary size)."""
    if tokenizer.name == "bytes":
        return dict(BYTES_IDENTITY)
    if not path or not os.path.isfile(os.path.join(path, RANKS_FILE)):
        raise InputError(f"the {tokenizer.name} tokenizer's files ({RANKS_FILE}) are not in {path!r}")
    extra = json.dumps({"special": sorted(tokenizer.special_tokens.items()), "pattern": tokenizer.pattern})
    return {"kind": tokenizer.name, "model_sha256": sha256_file(os.path.join(path, RANKS_FILE)),
            "special_sha256": hashlib.sha256(extra.encode()).hexdigest(), "vocab_size": int(tokenizer.vocab_size)}


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def encode_rows(tok: np.ndarray, seg: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[R, L] tokens, [R, L] segments, [R, L - 1] weights → [R, 4 (3 L - 1)] uint8: one record a row."""
    R = tok.shape[0]
    parts = (tok.astype("<i4"), seg.astype("<i4"), w.astype("<f4"))
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(R, -1) for p in parts], axis=1)


# ---- sources, streamed


def _records(path: str, kind: str | None = None) -> Iterator[tuple[str, object]]:
    """(kind, its field) of each line, checked as ``sniff_jsonl`` and the readers check it; ``kind`` None: the
    first line decides."""
    for n, rec in jsonl_records(path):
        has = [k for k in ("text", "messages") if k in rec]
        if len(has) != 1:
            raise InputError(f"{path}:{n}: a line needs exactly one of the fields \"text\" or \"messages\", "
                             f"has {has or list(rec)[:5]}")
        kind = kind or has[0]
        if has[0] != kind:
            raise InputError(f"{path}:{n}: a \"{has[0]}\" line in a \"{kind}\" file; put text and chat data in "
                             "separate files")
        if kind == "text" and not isinstance(rec["text"], str):
            raise InputError(f"--data: {path}:{n}: each JSONL line needs a string field \"text\"")
        if kind == "messages":
            check_messages(rec["messages"], f"{path}:{n}", need_assistant=True)
        yield kind, rec[kind]


def data_kind(paths) -> str:
    """"chat" when the files are ``{"messages"}`` JSONL, "text" otherwise (each file's first record decides; a mix
    is an InputError, as ``load_documents`` says)."""
    kinds = {}
    for p in map(os.fspath, paths):
        if not os.path.isfile(p):
            raise InputError(f"--data: no such file {p!r}")
        if (kind := next((k for k, _ in _records(p)), None) if p.endswith(".jsonl") else "text") is None:
            raise InputError(f"{p}: no records")
        kinds[p] = kind
    if not kinds:
        raise InputError("--data: no files")
    if "messages" in kinds.values() and "text" in kinds.values():
        chat, text = (", ".join(p for p, k in kinds.items() if (k == "messages") == c) for c in (True, False))
        raise InputError(f"--data: chat ({{\"messages\"}}) and text files cannot be mixed: {chat} vs {text}")
    return "chat" if "messages" in kinds.values() else "text"


def _text_pieces(paths) -> Iterator[bytes | None]:
    """Each document's bytes in pieces, None after each document."""
    for p in paths:
        if not p.endswith(".jsonl"):
            with open(p, "rb") as f:
                while piece := f.read(_CHUNK):
                    yield piece
            yield None
            continue
        for _, text in _records(p, "text"):
            yield text.encode("utf-8")
            yield None


def _text_blocks(paths, n_docs: int, N: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The first N bytes of the documents joined by newlines (each newline the last byte of the document before
    it), in blocks of about ``_CHUNK`` bytes: (tokens uint8, document index int64)."""
    pieces, docs, size, doc, emitted = [], [], 0, 0, 0
    for piece in _text_pieces(paths):
        this = doc
        if piece is None:
            doc += 1
            if this == n_docs - 1:
                continue
            piece = b"\n"
        pieces.append(piece[:N - emitted])
        docs.append(this)
        size, emitted = size + len(pieces[-1]), emitted + len(pieces[-1])
        if size >= _CHUNK or emitted >= N:
            yield (np.frombuffer(b"".join(pieces), np.uint8),
                   np.repeat(np.asarray(docs, np.int64), [len(p) for p in pieces]))
            pieces, docs, size = [], [], 0
        if emitted >= N:
            return


def _text_size(paths) -> tuple[int, int]:
    """(documents, bytes without the joining newlines): file sizes, ``{"text"}`` lines parsed."""
    docs = size = 0
    for p in paths:
        if p.endswith(".jsonl"):
            for _, text in _records(p, "text"):
                docs, size = docs + 1, size + len(text.encode("utf-8"))
        else:
            docs, size = docs + 1, size + os.path.getsize(p)
    return docs, size


# ---- rows


class _Files:
    """Rows of one split written as they come, ``rows_per_file`` records a file; counts what it wrote."""

    def __init__(self, root: str, split: str, rows_per_file: int):
        self.root, self.split, self.per_file = root, split, rows_per_file
        self.names, self.counts, self.writer, self.rows, self.predictions = [], [], None, 0, 0

    def add(self, tok, seg, w) -> None:
        self.predictions += int(np.count_nonzero(w))
        for rec in encode_rows(tok, seg, w):
            if self.writer is None or self.counts[-1] == self.per_file:
                self._roll()
            self.writer.write(rec.tobytes())
            self.counts[-1] += 1
        self.rows += tok.shape[0]

    def _roll(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.names.append(os.path.join(self.root, f".{self.split}-{len(self.names):05d}.partial"))
        self.counts.append(0)
        self.writer = ArrayRecordWriter(self.names[-1], WRITER_OPTIONS)

    def close(self) -> list[dict]:
        """The files renamed to their final names (their count is known now): [{name, split, rows, bytes, sha256}]."""
        if self.writer is not None:
            self.writer.close()
        out = []
        for i, (tmp, rows) in enumerate(zip(self.names, self.counts)):
            name = f"{self.split}-{i:05d}-of-{len(self.names):05d}.array_record"
            os.rename(tmp, path := os.path.join(self.root, name))
            out.append({"name": name, "split": self.split, "rows": rows, "bytes": os.path.getsize(path),
                        "sha256": sha256_file(path)})
        return out


class _StrideCutter:
    """A token stream pushed in pieces → rows ``[r T, r T + T + 1)`` (``data.stride_rows``)."""

    def __init__(self, files: _Files, seq_len: int):
        self.files, self.T = files, seq_len
        self.tok, self.doc = np.zeros(0, np.int32), np.zeros(0, np.int64)

    def push(self, tok: np.ndarray, doc: np.ndarray) -> None:
        tok, doc = np.concatenate([self.tok, tok.astype(np.int32)]), np.concatenate([self.doc, doc])
        k = (tok.size - 1) // self.T  # rows whose T + 1 tokens are all here
        for a in range(0, k, 8192):  # a block of rows at a time: the index arrays stay small
            idx = np.arange(a, min(a + 8192, k))[:, None] * self.T + np.arange(self.T + 1)[None, :]
            seg = (doc[idx] - doc[idx[:, :1]]).astype(np.int32)
            self.files.add(tok[idx], seg, prediction_weights(seg, None))
        self.tok, self.doc = tok[k * self.T:], doc[k * self.T:]  # the last token starts the next row

    def finish(self) -> None:
        n = self.tok.size
        if n >= 2:  # one token alone was the previous row's last prediction
            L = self.T + 1
            tok, seg = np.zeros((1, L), np.int32), np.full((1, L), -1, np.int32)
            tok[0, :n], seg[0, :n] = self.tok, self.doc - self.doc[0]
            self.files.add(tok, seg, prediction_weights(seg, seg >= 0))


class _Packer:
    """Conversations in order → ``data.pack_rows``' rows (pieces of at most L tokens, a row closed when the next
    piece does not fit)."""

    def __init__(self, files: _Files, seq_len: int):
        self.files, self.L = files, seq_len + 1
        self.row, self.used, self.done, self.cut = [], 0, [], 0

    def add(self, ids: np.ndarray, tgt: np.ndarray) -> None:
        self.cut += ids.size > self.L
        for i in range(0, ids.size, self.L):
            a, t = ids[i:i + self.L], tgt[i:i + self.L]
            if self.used + a.size > self.L:
                self._close()
            self.row.append((a, t))
            self.used += a.size

    def _close(self) -> None:
        L = self.L
        tok, seg, tgt = np.zeros(L, np.int32), np.full(L, -1, np.int32), np.zeros(L, bool)
        at = 0
        for i, (a, t) in enumerate(self.row):
            tok[at:at + a.size], seg[at:at + a.size], tgt[at:at + a.size] = a, i, t
            at += a.size
        self.done.append((tok, seg, tgt))
        self.row, self.used = [], 0
        if len(self.done) == 1024:
            self._flush()

    def _flush(self) -> None:
        if self.done:
            tok, seg, tgt = (np.stack(x) for x in zip(*self.done))
            self.files.add(tok, seg, prediction_weights(seg, tgt))
            self.done = []

    def finish(self) -> None:  # the last row, however full
        self._close()
        self._flush()


def _text_rows(paths, tmp, seq_len, max_bytes, heldout_frac, rows_per_file):
    n_docs, size = _text_size(paths)
    N = min(size + max(n_docs - 1, 0), max_bytes)
    if N == 0:
        raise InputError("--data: the corpus is empty")
    cut = N - int(N * heldout_frac)
    for what, n in (("training", cut), ("held-out", N - cut)):
        if n < seq_len + 2:
            raise InputError(f"--data: the {what} split has {n} bytes, fewer than seq_len + 2 = {seq_len + 2}")
    files = {s: _Files(tmp, s, rows_per_file) for s in ("train", "heldout")}
    cutters = {s: _StrideCutter(f, seq_len) for s, f in files.items()}
    counts, at = np.zeros(256, np.int64), 0
    for tok, doc in _text_blocks(paths, n_docs, N):
        k = min(max(cut - at, 0), tok.size)  # the block's training tokens
        if k:
            cutters["train"].push(tok[:k], doc[:k])
        if k < tok.size:
            cutters["heldout"].push(tok[k:], doc[k:])
            counts += np.bincount(tok[k:], minlength=256)
        at += tok.size
    for c in cutters.values():
        c.finish()
    splits = {"train": {"tokens": cut}, "heldout": {"tokens": N - cut, "unigram_counts": counts.tolist()}}
    return files, splits, {"bytes": N}


def _spill_chat(paths, tmp, max_tokens, tokenizer, template) -> tuple[int, int]:
    """Pass one: every conversation tokenized into spill files (ids int32, targets uint8, lengths int64)."""
    docs = total = 0
    with (open(os.path.join(tmp, ".ids"), "wb") as f_ids, open(os.path.join(tmp, ".tgt"), "wb") as f_tgt,
          open(os.path.join(tmp, ".len"), "wb") as f_len):
        for path in paths:
            got = 0
            for _, messages in _records(path, "messages"):
                got += 1
                a, t = encode_chat(messages, template, tokenizer, source=f"{path}: conversation {got}")
                f_ids.write(a.astype("<i4").tobytes())
                f_tgt.write(t.astype(np.uint8).tobytes())
                f_len.write(np.int64(a.size).tobytes())
                docs, total = docs + 1, total + int(a.size)
                if total >= max_tokens:
                    return docs, total
            if not got:
                raise InputError(f"{path}: no conversations")
    return docs, total


def _lengths(tmp) -> Iterator[int]:
    """The spilled conversations' lengths, read a block at a time."""
    with open(os.path.join(tmp, ".len"), "rb") as f:
        while block := f.read(8 << 20):
            yield from np.frombuffer(block, "<i8").tolist()


def _chat_rows(paths, tmp, seq_len, max_bytes, heldout_frac, rows_per_file, tokenizer, template):
    if tokenizer is None or template is None:
        raise InputError("--data: chat data needs the model's tokenizer and chat template")
    n_docs, N = _spill_chat(paths, tmp, max_bytes, tokenizer, template)
    if n_docs < 2:
        raise InputError("--data: a held-out split needs at least two conversations")
    cut, k, start = N - int(N * heldout_frac), n_docs, 0
    for i, n in enumerate(_lengths(tmp)):  # the first conversation that starts at or after the cut
        if start >= cut:
            k = i
            break
        start += n
    k = min(max(k, 1), n_docs - 1)  # at least one conversation on each side (split_documents' rule)
    files = {s: _Files(tmp, s, rows_per_file) for s in ("train", "heldout")}
    packers = {s: _Packer(f, seq_len) for s, f in files.items()}
    counts, n_train = np.zeros(max(int(tokenizer.vocab_size), 256), np.int64), 0
    with open(os.path.join(tmp, ".ids"), "rb") as f_ids, open(os.path.join(tmp, ".tgt"), "rb") as f_tgt:
        for i, n in enumerate(_lengths(tmp)):
            ids = np.frombuffer(f_ids.read(4 * n), "<i4").astype(np.int32)
            tgt = np.frombuffer(f_tgt.read(n), np.uint8).astype(bool)
            packers["train" if i < k else "heldout"].add(ids, tgt)
            if i < k:
                n_train += n
            else:
                np.add.at(counts, ids, 1)
    for name in (".ids", ".tgt", ".len"):
        os.remove(os.path.join(tmp, name))
    for p in packers.values():
        p.finish()
    held = {"tokens": N - n_train}
    if tokenizer.name == "bytes":
        held["unigram_counts"] = counts[:256].tolist()
    else:  # vocabularies past 256 take no `% vocab`: the entropy is final
        held["unigram_entropy"] = entropy_of_counts(counts)
    splits = {"train": {"tokens": n_train, "documents": k}, "heldout": held | {"documents": n_docs - k}}
    return files, splits, {"documents": n_docs, "tokens": N, "cut": sum(p.cut for p in packers.values())}


def write_shards(paths, out_dir, *, seq_len: int, tokenizer, template: str | None = None,
                 tokenizer_path: str | None = None, max_bytes: int | None = None,
                 heldout_frac: float = HELDOUT_FRAC, rows_per_file: int = ROWS_PER_FILE,
                 overwrite: bool = False) -> dict:
    """Tokenize ``paths`` into shards in ``out_dir`` (module docstring) and return the manifest written there:

    format, version, kind ("text" / "chat"), seq_len, the record layout, the tokenizer's identity
    (``tokenizer_identity``; text is always bytes, as ``load_documents`` reads it), the chat template's sha256
    (chat), heldout_frac and max_bytes, the sources (path, bytes), per split its rows, files, tokens and counted
    predictions (and the held-out unigram counts, or entropy past 256 ids), and each file's rows, bytes and sha256.

    ``tokenizer_path``: a non-byte tokenizer's checkpoint directory (its identity hashes the files). ``out_dir``
    must be missing or empty unless ``overwrite`` (InputError naming --out)."""
    paths = [os.fspath(p) for p in paths]
    for flag, bad in (("--seq-len", seq_len < 1), ("--max-bytes", max_bytes is not None and max_bytes < 1),
                      ("--heldout-frac", not 0 < heldout_frac < 1), ("rows_per_file", rows_per_file < 1)):
        if bad:
            raise InputError(f"{flag}: must be positive (a held-out fraction below 1)")
    kind = data_kind(paths)
    limit = math.inf if max_bytes is None else int(max_bytes)
    ident = BYTES_IDENTITY if kind == "text" else tokenizer_identity(tokenizer, tokenizer_path)
    with staged_dir(out_dir, overwrite=overwrite, flag="--out", hint="pass --overwrite") as tmp:
        if kind == "text":
            files, splits, extra = _text_rows(paths, tmp, seq_len, limit, heldout_frac, rows_per_file)
        else:
            files, splits, extra = _chat_rows(paths, tmp, seq_len, limit, heldout_frac, rows_per_file, tokenizer,
                                              template)
        listed = []
        for split, f in files.items():
            entries = f.close()
            listed += entries
            splits[split].update(rows=f.rows, predictions=f.predictions, files=[e["name"] for e in entries])
        L = seq_len + 1
        manifest = {
            "format": FORMAT, "version": VERSION, "kind": kind, "seq_len": seq_len,
            "record": {"layout": [["tokens", "<i4", L], ["segments", "<i4", L], ["weights", "<f4", L - 1]],
                       "bytes": 4 * (3 * L - 1), "writer_options": WRITER_OPTIONS},
            "tokenizer": ident, "chat_template_sha256": template_sha256(template) if kind == "chat" else None,
            "heldout_frac": heldout_frac, "max_bytes": max_bytes, "corpus": extra,
            "sources": [{"path": p, "bytes": os.path.getsize(p)} for p in paths],
            "splits": splits, "files": listed,
        }
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
            fh.write("\n")
    return manifest


__all__ = ["BYTES_IDENTITY", "FORMAT", "MANIFEST", "ROWS_PER_FILE", "VERSION", "data_kind", "encode_rows",
           "entropy_of_counts", "prediction_weights", "template_sha256",
           "tokenizer_identity", "write_shards"]
