"""Pre-tokenized shards (`k3 tokenize`, k3jax/train/shards.py) and the streaming loader (k3jax/train/stream.py): the
rows on disk are the in-memory path's (``pack_rows`` / ``stride_rows`` of ``split_documents``' splits), a batch is
a pure function of (seed, step) whatever share of it a process asks for, and every mismatch between the directory,
its manifest and the run is an InputError naming the file or flag."""

import base64
import json
import os
import shutil

import grain.python as grain
import numpy as np
import pytest

from k3jax.chat import BUILTIN_TEMPLATE
from k3jax.checkpoint.container import sha256_file
from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.data import stdlib_files
from k3jax.errors import InputError
from k3jax.tokenizer import ByteTokenizer, KimiTokenizer
from k3jax.train import data as tdata
from k3jax.train import shards
from k3jax.train.settings import TrainConfig
from k3jax.train.stream import decode_rows, open_shards, read_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT = [os.path.join(ROOT, "experiments", "sft", n) for n in ("chat_train.jsonl", "chat_heldout.jsonl")]
BYTES = {"kind": "bytes"}


def _split_rows(root, m, split):
    src = grain.ArrayRecordDataSource([os.path.join(root, n) for n in m["splits"][split]["files"]])
    return decode_rows(src.__getitems__(list(range(len(src)))), m["seq_len"])


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in ("tokens", "segments", "weights"))


def _text_files(tmp_path):
    """Eight stdlib sources (92 kB), an empty file and a {"text"} JSONL with an empty line: every kind of document."""
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "lines.jsonl").write_text('{"text": "hello"}\n{"text": ""}\n\n{"text": "wide world \\u00e9"}\n')
    return [*stdlib_files()[:8], str(tmp_path / "empty.txt"), str(tmp_path / "lines.jsonl")]


@pytest.fixture(scope="module")
def sft_shards(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft") / "shards")
    assert main(["tokenize", "--data", *SFT, "--out", out, "--preset", "k3-mini", "--seq-len", "128"]) == 0
    return out


def test_tokenize_sft_chat_rows_equal_pack_rows_of_the_in_memory_split(sft_shards):
    m, _ = read_manifest(sft_shards)
    corpus = tdata.load_documents(SFT, max_bytes=1 << 40, tokenizer=ByteTokenizer(), template=BUILTIN_TEMPLATE)
    train, held = tdata.split_documents(corpus)
    for split, part in (("train", train), ("heldout", held)):
        want = tdata.pack_rows(part, 128)
        assert _same(_split_rows(sft_shards, m, split), want), split
        assert m["splits"][split]["rows"] == want["tokens"].shape[0]
        assert m["splits"][split]["tokens"] == part.tokens.size
        assert m["splits"][split]["predictions"] == int(want["weights"].sum())
    assert m["kind"] == "chat" and m["tokenizer"] == BYTES and m["splits"]["train"]["documents"] == train.doc[-1] + 1
    assert m["chat_template_sha256"] == shards.template_sha256(BUILTIN_TEMPLATE)


def test_prepare_on_a_shard_dir_matches_the_in_memory_run(sft_shards):
    """``prepare`` with ``--data DIR``: the held-out rows and entropy of the in-memory run on the same files (k3-tiny:
    ids % 97), and a log line that says --max-bytes is not read."""
    cfg, logs = get_preset("k3-tiny"), []
    tc = TrainConfig(preset="k3-tiny", seq_len=128, data=(sft_shards,), max_bytes=1 << 40, eval_windows=8)
    got = tdata.prepare(tc, cfg, 2, logs.append)
    want = tdata.prepare(tc.replace(data=tuple(SFT)), cfg, 2, lambda m: None)
    assert got.vocab == want.vocab == 97 and got.packing and got.train_toks is None
    assert abs(got.held_entropy - want.held_entropy) < 1e-12
    for a, b in zip(got.eval_set, want.eval_set, strict=True):
        assert np.array_equal(a, b)
    assert any("--max-bytes" in line and sft_shards in line for line in logs)
    b = got.batch(seed=0, step=3, batch=4, seq_len=128)
    assert b["tokens"].max() < 97 and b["tokens"].shape == (4, 129) and b["weights"].shape == (4, 128)
    flat = tdata.prepare(tc.replace(packing_masks=False), cfg, 2, lambda m: None)
    fb = flat.batch(seed=0, step=3, batch=4, seq_len=128)
    assert not fb["segments"].any() and np.array_equal(fb["weights"], b["weights"])   # chat keeps its weights


def test_text_rows_are_the_stride_cut_of_load_documents(tmp_path, monkeypatch):
    """Text streamed in small blocks (so rows and documents straddle them) into several files per split: the rows
    of ``stride_rows`` over ``split_documents``' two splits of the same files, with and without --max-bytes."""
    monkeypatch.setattr(shards, "_CHUNK", 5000)
    paths = _text_files(tmp_path)
    for max_bytes in (None, 70_001):
        out = str(tmp_path / f"text-{max_bytes}")
        m = shards.write_shards(paths, out, seq_len=64, tokenizer=ByteTokenizer(), max_bytes=max_bytes,
                                rows_per_file=50)
        train, held = tdata.split_documents(tdata.load_documents(paths, max_bytes=max_bytes or 1 << 40))
        for split, part in (("train", train), ("heldout", held)):
            want = tdata.stride_rows(part, 64)
            assert _same(_split_rows(out, m, split), want), (max_bytes, split)
            assert m["splits"][split]["tokens"] == part.tokens.size
        assert len(m["splits"]["train"]["files"]) > 2 and m["tokenizer"] == BYTES
        data = open_shards(out, seq_len=64, tokenizer_identity=BYTES, vocab=97)
        assert abs(data.held_entropy - tdata.unigram_entropy(held.tokens, 97)) < 1e-12


def _tiny_bpe(d, merges):
    """A Kimi-style tokenizer directory: 256 byte ranks, ``merges``, two special tokens."""
    ranks = [bytes([i]) for i in range(256)] + merges
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    specials = {len(ranks): "<|end|>", len(ranks) + 1: "<|user|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in specials.items()}}))
    return KimiTokenizer.from_dir(str(d), 300)


def test_chat_with_a_bpe_tokenizer_names_its_files_in_the_identity(tmp_path):
    """A BPE tokenizer: the rows are still pack_rows', the identity hashes the ranks file (another merge list is
    another tokenizer, refused when the shards are opened), and the held-out entropy is stored (no % vocab)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    tok = _tiny_bpe(tmp_path / "a", [b"th", b"the", b"er"])
    other = shards.tokenizer_identity(_tiny_bpe(tmp_path / "b", [b"th", b"the", b"re"]), str(tmp_path / "b"))
    out = str(tmp_path / "bpe")
    m = shards.write_shards(SFT[1:], out, seq_len=64, tokenizer=tok, template=BUILTIN_TEMPLATE,
                            tokenizer_path=str(tmp_path / "a"))
    ident = shards.tokenizer_identity(tok, str(tmp_path / "a"))
    assert m["tokenizer"] == ident and ident["kind"] == "tiktoken" and ident["vocab_size"] == 300
    assert ident["model_sha256"] == sha256_file(str(tmp_path / "a" / "tiktoken.model")) != other[
        "model_sha256"]
    train, held = tdata.split_documents(tdata.load_documents(SFT[1:], tokenizer=tok, template=BUILTIN_TEMPLATE))
    for split, part in (("train", train), ("heldout", held)):
        assert _same(_split_rows(out, m, split), tdata.pack_rows(part, 64)), split
    assert _split_rows(out, m, "train")["tokens"].max() >= 256                      # merges and specials: raw ids
    data = open_shards(out, seq_len=64, tokenizer_identity=ident)
    assert abs(data.held_entropy - tdata.unigram_entropy(held.tokens, 300)) < 1e-12
    with pytest.raises(InputError, match="manifest.json: the shards were tokenized by"):
        open_shards(out, seq_len=64, tokenizer_identity=other)


def test_stride_rows_cover_every_prediction_once():
    c = tdata.Corpus(np.arange(10, dtype=np.uint8), np.array([0] * 4 + [1] * 6, np.int32), None)
    r = tdata.stride_rows(c, 4)
    assert r["tokens"].tolist() == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 0, 0, 0]]
    assert r["segments"].tolist() == [[0, 0, 0, 0, 1], [0, 0, 0, 0, 0], [0, 0, -1, -1, -1]]
    assert r["weights"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_batch_is_one_function_of_seed_and_step_for_any_share_of_rows(sft_shards):
    data = open_shards(sft_shards, seq_len=128, tokenizer_identity=BYTES)
    again = open_shards(sft_shards, seq_len=128, tokenizer_identity=BYTES, verify=False)
    full = data.batch(seed=5, step=7, batch=8, seq_len=128)
    halves = [again.batch(seed=5, step=7, batch=8, seq_len=128, rows=np.arange(a, a + 4)) for a in (0, 4)]
    assert _same(full, {k: np.concatenate([h[k] for h in halves]) for k in full})
    odd = again.batch(seed=5, step=7, batch=8, seq_len=128, rows=[6, 1])
    assert _same(odd, {k: v[[6, 1]] for k, v in full.items()})
    assert not np.array_equal(full["tokens"], data.batch(seed=5, step=8, batch=8, seq_len=128)["tokens"])
    assert not np.array_equal(full["tokens"], data.batch(seed=6, step=7, batch=8, seq_len=128)["tokens"])
    R = data.num_rows
    # each epoch visits every row once, and the next epoch in another order
    ids = np.concatenate([data.record_ids(seed=5, step=s, batch=100, rows=None) for s in range(-(-2 * R // 100))])
    assert sorted(ids[:R]) == list(range(R)) and sorted(ids[R:2 * R]) == list(range(R))
    assert not np.array_equal(ids[:R], ids[R:2 * R])


def test_in_memory_batch_rows_are_rows_of_the_global_batch():
    c = tdata.load_documents(None, max_bytes=40_000)
    for packing in (False, True):
        d = tdata.TrainData(c, None, 0.0, 97, packing)
        full = d.batch(seed=1, step=2, batch=6, seq_len=16)
        part = d.batch(seed=1, step=2, batch=6, seq_len=16, rows=np.array([5, 0, 3]))
        if packing:
            assert all(np.array_equal(part[k], full[k][[5, 0, 3]]) for k in full)
        else:
            assert np.array_equal(part, full[[5, 0, 3]])


def test_state_round_trip_and_a_checkpoint_of_other_shards(sft_shards, tmp_path):
    data = open_shards(sft_shards, seq_len=128, tokenizer_identity=BYTES)
    data.batch(seed=3, step=11, batch=2, seq_len=128)
    st = json.loads(json.dumps(data.state()))
    assert st["seed"] == 3 and st["next_step"] == 12 and len(st["manifest"]) == 64
    open_shards(sft_shards, seq_len=128, tokenizer_identity=BYTES, verify=False).check_state(st)
    other = str(tmp_path / "other")
    shards.write_shards(SFT[1:], other, seq_len=128, tokenizer=ByteTokenizer(), template=BUILTIN_TEMPLATE)
    with pytest.raises(InputError, match="other") as e:
        open_shards(other, seq_len=128, tokenizer_identity=BYTES).check_state(st)
    assert other in str(e.value)
    with pytest.raises(InputError, match="other data"):
        data.check_state({"source": "memory"})


def _copy(src, tmp_path, name):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def test_bad_shard_directories_name_the_file_or_flag(sft_shards, tmp_path):
    m, _ = read_manifest(sft_shards)
    train0 = m["splits"]["train"]["files"][0]
    edited = _copy(sft_shards, tmp_path, "edited")
    with open(os.path.join(edited, train0), "r+b") as f:     # same size, one byte changed
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(InputError, match="sha256") as e:
        open_shards(edited, seq_len=128, tokenizer_identity=BYTES)
    assert os.path.join(edited, train0) in str(e.value)
    missing = _copy(sft_shards, tmp_path, "missing")
    os.remove(os.path.join(missing, m["splits"]["heldout"]["files"][0]))
    with pytest.raises(InputError, match="missing") as e:
        open_shards(missing, seq_len=128, tokenizer_identity=BYTES)
    assert "heldout-00000-of-00001.array_record" in str(e.value)
    extra = _copy(sft_shards, tmp_path, "extra")
    open(os.path.join(extra, "train-00009-of-00009.array_record"), "wb").close()
    with pytest.raises(InputError, match="train-00009-of-00009.array_record: not listed"):
        open_shards(extra, seq_len=128, tokenizer_identity=BYTES, verify=False)
    with pytest.raises(InputError, match="--seq-len 64: .* seq_len 128"):
        open_shards(sft_shards, seq_len=64, tokenizer_identity=BYTES)
    kimi = {"kind": "tiktoken", "model_sha256": "0" * 64, "special_sha256": "0" * 64, "vocab_size": 163840}
    with pytest.raises(InputError, match="manifest.json: the shards were tokenized by"):
        open_shards(sft_shards, seq_len=128, tokenizer_identity=kimi)
    with pytest.raises(InputError, match="another chat template"):
        open_shards(sft_shards, seq_len=128, tokenizer_identity=BYTES, template=BUILTIN_TEMPLATE + " ")
    with pytest.raises(InputError, match="--seq-len 64"):
        tdata.prepare(TrainConfig(preset="k3-tiny", seq_len=64, data=(sft_shards,)), get_preset("k3-tiny"), 1,
                      lambda m: None)


def test_tokenize_refuses_a_non_empty_out_and_bad_data_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["tokenize", "--data", SFT[1], "--out", str(out), "--preset", "k3-mini"]) == 2
    assert "--out" in capsys.readouterr().err and os.listdir(out) == ["keep.txt"]
    (tmp_path / "t.txt").write_text("plain text")
    fresh = tmp_path / "fresh"
    assert main(["tokenize", "--data", SFT[1], str(tmp_path / "t.txt"), "--out", str(fresh)]) == 2
    assert "cannot be mixed" in capsys.readouterr().err and not fresh.exists()
    assert main(["tokenize", "--data", str(tmp_path / "t.txt"), "--out", str(fresh), "--seq-len", "8"]) == 2
    assert "held-out split has 0 bytes" in capsys.readouterr().err
    assert not fresh.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".fresh")]


@pytest.mark.slow  # compiles a train step (tens of seconds)
def test_bench_data_reports_the_loader_against_the_train_step(capsys):
    argv = ["bench", "data", "--json", "--preset", "k3-tiny", "--layers", "2", "--batch", "4", "--seq-len", "16",
            "--steps", "20", "--reps", "1", "--corpus-bytes", "200000"]
    rc = main(argv)
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "data" and set(out["ratios"]) == {"loader_over_step", "tokenize_mb_per_s"}
    assert out["shape"]["rows_read_per_step"] == 2 and out["shape"]["corpus_bytes"] == 200_000
    assert out["ok"] == (out["ratios"]["loader_over_step"] >= 5) and rc == (0 if out["ok"] else 1)
    assert out["rows_per_s"]["loader"] > 0 and out["rows_per_s"]["train_step"] > 0
