"""Training batches streamed from pre-tokenized shards (``k3jax.train.shards``, `k3 tokenize`): the run's data when
``--data`` is one shard directory, with ``k3jax.train.data.TrainData``'s interface.

    data = open_shards("shards/", seq_len=128, tokenizer_identity=tokenizer_identity(tok, ckpt))
    b = data.batch(seed=0, step=17, batch=16, seq_len=128, rows=np.arange(8, 16))   # this process's half
    data.eval_set, data.held_entropy                                                 # as TrainData's

``open_shards`` checks the directory against its manifest before anything is read: every listed file present with
its size (and, with ``verify``, its sha256), no other file, the seq_len and the tokenizer (and chat template) the
rows were made with; each mismatch is an InputError naming the file or ``--seq-len``.

The global batch of step s is a pure function of (seed, s), whatever the number of processes: its example r is
position i = s * batch + r of an endless sequence of epochs over the R training rows, position i is row
``shuffle_e(i mod R)`` of epoch e = i // R, and ``shuffle_e`` is grain's index shuffle (a bijection of [0, R)
computed per index, so no permutation of all rows is ever held) seeded from (seed, e). A process asks only for its
own rows of the batch (``rows``) and reads only their records (``grain.python.ArrayRecordDataSource``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import grain.python as grain
import numpy as np

from k3jax.checkpoint.container import sha256_file
from k3jax.errors import InputError
from k3jax.train.evaluate import Windows
from k3jax.train.shards import FORMAT, MANIFEST, VERSION, entropy_of_counts, template_sha256


def read_manifest(root: str) -> tuple[dict, str]:
    """(manifest, sha256 of manifest.json's bytes) of a shard directory; InputError naming the file."""
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        m = json.loads(raw)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        raise InputError(f"{path}: not a {FORMAT} version {VERSION} manifest (written by `k3 tokenize`)")
    return m, hashlib.sha256(raw).hexdigest()


def decode_rows(records, seq_len: int, where: str = "") -> dict:
    """``encode_rows``' records back to {"tokens", "segments" [R, L] int32, "weights" [R, L - 1] float32}."""
    L = seq_len + 1
    if any(len(r) != 4 * (3 * L - 1) for r in records):
        raise InputError(f"{where}: a record is not one row of {L} tokens ({4 * (3 * L - 1)} bytes)")
    words = np.frombuffer(b"".join(records), "<i4").reshape(len(records), 3 * L - 1)
    return {"tokens": words[:, :L].astype(np.int32), "segments": words[:, L:2 * L].astype(np.int32),
            "weights": words[:, 2 * L:].view("<f4").astype(np.float32)}


class _GroupSizeNote(logging.Filter):
    """array_record logs an error for every shard file opened whose group size is not 1, telling the user to rewrite
    the files; ours are 16 on purpose (``shards.WRITER_OPTIONS``), so that line is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("File %s was created with group size")


logging.getLogger("absl").addFilter(_GroupSizeNote())


def _source(root: str, manifest: dict, split: str) -> grain.ArrayRecordDataSource:
    """A split's files as one grain source; ``path[0:rows]`` (the manifest's counts, checked by size and sha256)
    spares opening every file to count its records."""
    rows = {f["name"]: f["rows"] for f in manifest["files"]}
    return grain.ArrayRecordDataSource([f"{os.path.join(root, n)}[0:{rows[n]}]"
                                        for n in manifest["splits"][split]["files"]])


def shuffle_seed(seed: int) -> int:
    """grain's shuffle seed for a run seed. grain seeds epoch e with seed + e, so seeds s and s + 1 would see the
    same orders one epoch apart: the run seed is hashed first."""
    return int.from_bytes(hashlib.sha256(f"k3jax shards {int(seed)}".encode()).digest()[:4], "little")


class ShardData:
    """A run's data read from shards (``open_shards``): ``TrainData``'s ``batch``, ``eval_set``, ``held_entropy``,
    ``vocab`` and ``packing``, and the data position to save with a checkpoint (``state`` / ``check_state``)."""

    packing = True  # batches are always {"tokens", "segments", "weights"}

    def __init__(self, root: str, manifest: dict, manifest_sha256: str, *, vocab: int = 256,
                 packing_masks: bool = True, n_eval: int = 32):
        self.root, self.manifest, self.manifest_sha256 = root, manifest, manifest_sha256
        self.seq_len, self.kind = int(manifest["seq_len"]), manifest["kind"]
        self.vocab, self.packing_masks = vocab, packing_masks
        train = manifest["splits"]["train"]
        self.num_rows = int(train["rows"])
        self._source = _source(root, manifest, "train")
        self._seed, self._order, self._next_step = None, None, 0
        held = manifest["splits"]["heldout"]
        counts = held.get("unigram_counts")
        self.held_entropy = entropy_of_counts(np.asarray(counts), vocab) if counts is not None else float(
            held["unigram_entropy"])
        self.eval_set = self._eval_set(held, n_eval)

    @property
    def train_toks(self):
        """None: the training tokens stay on disk (``TrainData.train_toks`` is the in-memory stream)."""
        return None

    def _view(self, rows: dict) -> dict:
        """Records as the step sees them: ids ``% vocab`` below 256; ``--no-packing-masks``: one sequence a row to
        the mixers (segments 0) and, for text, every real next token predicted (plain windows, as in memory)."""
        tok, seg, w = rows["tokens"], rows["segments"], rows["weights"]
        if self.vocab < 256:
            tok = tok % self.vocab
        if not self.packing_masks:
            if self.kind == "text":
                w = (seg[:, 1:] >= 0).astype(np.float32)  # padding (-1) stays unscored
            seg = np.zeros_like(seg)
        return {"tokens": tok, "segments": seg, "weights": w}

    def _eval_set(self, held: dict, n_eval: int) -> Windows:
        R = int(held["rows"])
        if R == 0:
            raise InputError(f"{os.path.join(self.root, MANIFEST)}: no held-out rows")
        # text: rows spread over the held-out split (as the in-memory run's spaced windows); chat: the first ones
        pick = (np.linspace(0, R - 1, n_eval).astype(np.int64) if self.kind == "text" else
                np.arange(min(n_eval, R)))
        src = _source(self.root, self.manifest, "heldout")
        rows = self._view(decode_rows(src.__getitems__([int(i) for i in pick]), self.seq_len, self.root))
        return Windows(rows["tokens"], rows["weights"], rows["segments"])

    def record_ids(self, *, seed: int, step: int, batch: int, rows=None) -> np.ndarray:
        """[len(rows)] int64 training-row indices of the global batch's rows ``rows`` (None: all) at step ``step``."""
        r = np.arange(batch) if rows is None else np.asarray(rows, np.int64).reshape(-1)
        if r.size and (r.min() < 0 or r.max() >= batch):
            raise ValueError(f"rows must lie in [0, {batch}), got {r.min()}..{r.max()}")
        if self._seed != seed:
            self._order = grain.MapDataset.range(self.num_rows).shuffle(seed=shuffle_seed(seed))
            self._seed = seed
        return np.array([self._order[int(i)] for i in step * batch + r], np.int64)

    def batch(self, *, seed: int, step: int, batch: int, seq_len: int, rows=None) -> dict:
        """{"tokens", "segments" [b, seq_len + 1] int32, "weights" [b, seq_len] float32} of the global batch's rows
        ``rows`` (global row indices in [0, batch); None: all ``batch``) at step ``step``."""
        if seq_len != self.seq_len:
            raise InputError(f"--seq-len {seq_len}: the shards in {self.root} hold rows of --seq-len {self.seq_len}")
        ids = self.record_ids(seed=seed, step=step, batch=batch, rows=rows)
        records = self._source.__getitems__([int(i) for i in ids]) if ids.size else []
        out = self._view(decode_rows(records, self.seq_len, self.root))
        self._next_step = step + 1
        return out

    def state(self, step: int | None = None) -> dict:
        """The data position to keep with a checkpoint: which shards ("manifest": the sha256 of manifest.json's
        bytes, the same in every process wherever the directory is mounted), the seed of the last batch read, and
        the next step to read (``step``, else the one after the last batch read)."""
        return {"manifest": self.manifest_sha256, "seed": self._seed,
                "next_step": self._next_step if step is None else int(step)}

    def check_state(self, saved: dict | None) -> None:
        """A checkpoint's ``state()`` must name these shards: InputError naming the directory otherwise."""
        theirs = saved.get("manifest") if isinstance(saved, dict) else None
        if theirs != self.manifest_sha256:
            what = "other data" if theirs is None else f"the shards with manifest sha256 {str(theirs)[:16]}..."
            raise InputError(f"--data {self.root}: the checkpoint was trained on {what}, this {MANIFEST} is "
                             f"{self.manifest_sha256[:16]}... (not the same shards)")


def check_files(root: str, manifest: dict, *, verify: bool = True) -> None:
    """Every file the manifest lists is there with its size (and sha256 with ``verify``), and no other file."""
    listed = {f["name"]: f for f in manifest["files"]}
    for name in sorted(set(os.listdir(root)) - set(listed) - {MANIFEST}):
        raise InputError(f"{os.path.join(root, name)}: not listed in {MANIFEST} (a file of other shards?)")
    for name, f in listed.items():
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise InputError(f"{path}: missing (listed in {MANIFEST})")
        if os.path.getsize(path) != f["bytes"]:
            raise InputError(f"{path}: {os.path.getsize(path)} bytes, {MANIFEST} says {f['bytes']}")
        if verify and sha256_file(path) != f["sha256"]:
            raise InputError(f"{path}: sha256 differs from {MANIFEST}'s (the file changed after `k3 tokenize`)")


def open_shards(root, *, seq_len: int, tokenizer_identity: dict, verify: bool = True, template: str | None = None,
                vocab: int = 256, packing_masks: bool = True, n_eval: int = 32) -> ShardData:
    """The shards in ``root`` checked (module docstring) and opened. ``tokenizer_identity``: the model's
    (``shards.tokenizer_identity``); ``template``: the model's chat template, compared for chat shards when given;
    ``vocab``, ``packing_masks``, ``n_eval``: as ``TrainData``'s (ids % vocab below 256, segments, eval rows)."""
    root = os.fspath(root)
    manifest, sha = read_manifest(root)
    where = os.path.join(root, MANIFEST)
    if int(manifest["seq_len"]) != seq_len:
        raise InputError(f"--seq-len {seq_len}: the shards in {root} hold rows of seq_len {manifest['seq_len']} "
                         f"(`k3 tokenize --seq-len {manifest['seq_len']}`)")
    if manifest["tokenizer"] != tokenizer_identity:
        raise InputError(f"{where}: the shards were tokenized by {manifest['tokenizer']}, the model's tokenizer is "
                         f"{tokenizer_identity}")
    if template is not None and manifest["kind"] == "chat" and manifest["chat_template_sha256"] != template_sha256(
            template):
        raise InputError(f"{where}: the conversations were rendered by another chat template than the model's "
                         f"(sha256 {manifest['chat_template_sha256'][:16]}... vs {template_sha256(template)[:16]}...)")
    check_files(root, manifest, verify=verify)
    return ShardData(root, manifest, sha, vocab=vocab, packing_masks=packing_masks, n_eval=n_eval)


def is_shard_dir(paths) -> bool:
    """``--data`` names exactly one directory holding a manifest.json."""
    return len(paths) == 1 and os.path.isfile(os.path.join(os.fspath(paths[0]), MANIFEST))


__all__ = ["ShardData", "check_files", "decode_rows", "is_shard_dir", "open_shards", "read_manifest", "shuffle_seed"]
