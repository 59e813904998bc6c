"""Training data as documents: packed batches, their document ids and weights, chat rows,
the packed train step's loss, resume keys and bad input. The mixers' document masks are tests/model/test_packing.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.chat import BUILTIN_TEMPLATE
from k3jax.cli.main import main
from k3jax.config import default_run, get_preset
from k3jax.errors import InputError
from k3jax.model import forward, init_params
from k3jax.tokenizer import ByteTokenizer
from k3jax.train import data as tdata
from k3jax.train.settings import TrainConfig, resume_diff
from k3jax.train.step import StepSpec, make_loss

CHAT = [
    [{"role": "user", "content": "up cat"}, {"role": "assistant", "content": "CAT"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3"},
     {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "rev dog"}, {"role": "assistant", "content": "god"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "god"}],
]


def _chat_file(tmp_path, convs=CHAT, n=1):
    p = tmp_path / "chat.jsonl"
    p.write_text("".join(json.dumps({"messages": m}) + "\n" for _ in range(n) for m in convs))
    return str(p)


def _chat_corpus(tmp_path, n=1):
    return tdata.load_documents([_chat_file(tmp_path, n=n)], tokenizer=ByteTokenizer(), template=BUILTIN_TEMPLATE)


def test_text_documents_keep_the_stream_and_number_each_file_and_line(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    a.write_bytes(b"first file")
    b.write_text('{"text": "one"}\n{"text": "two"}\n')
    c = tdata.load_documents([str(a), str(b)])
    assert c.tokens.tobytes() == tdata.load_corpus([str(a), str(b)]).tobytes() == b"first file\none\ntwo"
    assert c.doc.tolist() == [0] * 11 + [1] * 4 + [2] * 3 and c.target is None
    std = tdata.load_documents(None, max_bytes=50_000)
    assert std.tokens.tobytes() == tdata.load_corpus(None, max_bytes=50_000).tobytes()
    assert np.all(np.diff(std.doc) >= 0) and std.doc[-1] > 0            # one document per stdlib file


def test_text_windows_equal_batch_at_and_weights_skip_boundaries():
    c = tdata.load_documents(None, max_bytes=100_000)
    b = tdata.packed_batch_at(c, seed=3, step=11, batch=8, seq_len=64, vocab=97)
    assert np.array_equal(b["tokens"], tdata.batch_at(c.tokens, seed=3, step=11, batch=8, seq_len=64, vocab=97))
    seg = b["segments"]
    assert np.array_equal(b["weights"], (seg[:, 1:] == seg[:, :-1]).astype(np.float32))
    again = tdata.packed_batch_at(c, seed=3, step=11, batch=8, seq_len=64, vocab=97)
    assert all(np.array_equal(b[k], again[k]) for k in b)                 # a pure function of (seed, step)


def test_chat_rows_pack_whole_conversations_with_assistant_only_weights(tmp_path):
    c = _chat_corpus(tmp_path)
    assert c.chat and c.doc.max() == 2
    rows = tdata.pack_rows(c, seq_len=119)
    assert rows["tokens"].shape == (2, 120)                             # 46 + 68 tokens and padding, then 92 + padding
    for r, seg in enumerate(rows["segments"]):                          # whole conversations, padding at the end
        real = seg >= 0
        assert np.all(np.diff(seg[real]) >= 0)
        assert not real.all() and not np.any(real[np.argmin(real):])
        starts = np.flatnonzero(np.diff(seg, prepend=-2) & real)
        assert all(bytes(rows["tokens"][r][a:a + 8].astype(np.uint8)) == b"<|user|>" or
                   bytes(rows["tokens"][r][a:a + 10].astype(np.uint8)) == b"<|system|>" for a in starts)
    scored = "".join(chr(int(x)) for r in range(rows["tokens"].shape[0]) for x, w in
                     zip(rows["tokens"][r][1:], rows["weights"][r], strict=True) if w)
    assert scored == "CAT<|end|>\n5<|end|>\ngod<|end|>\ngod<|end|>\n"  # the assistant's tokens, nothing else
    assert rows["cut"] == 0


def test_chat_long_conversation_is_cut_into_row_sized_pieces(tmp_path):
    rows = tdata.pack_rows(_chat_corpus(tmp_path), seq_len=15)
    assert rows["cut"] == 3 and rows["tokens"].shape[1] == 16
    assert not np.any(rows["weights"][rows["segments"][:, 1:] < 0])


def test_chat_batches_visit_every_row_once_per_epoch(tmp_path):
    c = _chat_corpus(tmp_path, n=8)
    rows = tdata.pack_rows(c, seq_len=63)
    R = rows["tokens"].shape[0]
    seen = np.concatenate([tdata.packed_batch_at(c, seed=1, step=s, batch=3, seq_len=63, rows=rows)["tokens"]
                           for s in range(-(-R // 3) + 1)])
    first = seen[:R]
    assert sorted(map(bytes, first.astype(np.uint8))) == sorted(map(bytes, rows["tokens"].astype(np.uint8)))


def test_chat_split_is_at_a_conversation_boundary(tmp_path):
    train, held = tdata.split_documents(_chat_corpus(tmp_path, n=4), 0.3)
    assert train.doc[-1] != held.doc[0] and held.tokens.size and train.tokens.size
    assert bytes(held.tokens[:8].astype(np.uint8)).startswith(b"<|")


def test_packed_step_loss_is_the_mean_over_weighted_predictions():
    """make_loss on a packed batch in 2 micro-batches: the sum of the micro-batch losses == the weighted mean of the
    per-token cross-entropy of the documents run on their own rows."""
    cfg = get_preset("k3-tiny")
    run = default_run(cfg)
    params = init_params(cfg, jax.random.key(0), run)
    c = tdata.load_documents(None, max_bytes=30_000)
    b = tdata.packed_batch_at(c, seed=0, step=0, batch=4, seq_len=24, vocab=97)
    b["weights"][0] = 0.0                                              # a row that scores nothing still counts right
    loss_fn = make_loss(cfg, run, StepSpec(balance="off"))
    norm = max(b["weights"].sum(), 1.0) / 2
    total = sum(float(loss_fn(params, {k: v[i:i + 2] for k, v in b.items()}, norm)[0]) for i in (0, 2)) / 2
    logits = forward(params, jnp.asarray(b["tokens"][:, :-1]), cfg, run, segment_ids=jnp.asarray(b["segments"][:, :-1]))
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(b["tokens"][:, 1:])))
    want = float((ce * b["weights"]).sum() / b["weights"].sum())
    assert abs(total - want) <= 1e-5 * abs(want)


def test_packing_masks_is_a_resume_key_older_checkpoints_ran_without():
    now = TrainConfig(preset="k3-tiny").resume_key()
    old = {k: v for k, v in now.items() if k != "packing_masks"}
    assert resume_diff(old, now) == ["packing_masks"]
    assert resume_diff(old, TrainConfig(preset="k3-tiny", packing_masks=False).resume_key()) == []


def test_no_packing_masks_keeps_todays_batches():
    """--no-packing-masks: the run's data hands the step plain token windows, those of the pipeline before document
    masks (the stdlib bytes, the stream's tail held out, ``batch_at``), and plain held-out windows."""
    from k3jax.data import stdlib_bytes

    tc = TrainConfig(preset="k3-tiny", seq_len=32, max_bytes=50_000, packing_masks=False)
    d = tdata.prepare(tc, get_preset("k3-tiny"), 1, lambda m: None)
    train = stdlib_bytes(50_000)[: 50_000 - int(50_000 * tc.heldout_frac)]
    x = d.batch(seed=2, step=5, batch=4, seq_len=32)
    assert isinstance(x, np.ndarray)
    assert np.array_equal(x, tdata.batch_at(train, seed=2, step=5, batch=4, seq_len=32, vocab=97))
    assert d.eval_set.segments is None and d.eval_set.mask is None
    masked = tdata.prepare(tc.replace(packing_masks=True), get_preset("k3-tiny"), 1, lambda m: None)
    y = masked.batch(seed=2, step=5, batch=4, seq_len=32)
    assert np.array_equal(y["tokens"], x) and masked.eval_set.segments is not None


def test_mixed_chat_and_text_and_missing_template_are_input_errors(tmp_path):
    t = tmp_path / "t.txt"
    t.write_text("plain")
    chat = _chat_file(tmp_path)
    with pytest.raises(InputError, match="cannot be mixed"):
        tdata.load_documents([chat, str(t)], tokenizer=ByteTokenizer(), template=BUILTIN_TEMPLATE)
    with pytest.raises(InputError, match="tokenizer and chat template"):
        tdata.load_documents([chat])


@pytest.mark.parametrize("conv,msg", [
    ([{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}], "robot"),
    ([{"role": "user", "content": "x"}], "no assistant"),
], ids=["unknown-role", "no-assistant"])
def test_bad_chat_data_exits_2_before_compute(conv, msg, tmp_path, capsys, monkeypatch):
    path = _chat_file(tmp_path, convs=[CHAT[0], conv])
    import k3jax.train.loop as loop_mod

    def boom(*a, **k):
        raise AssertionError("initialised parameters despite bad input")

    monkeypatch.setattr(loop_mod, "initial_params", boom)
    rc = main(["train", "--preset", "k3-tiny", "--data", path, "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert msg in err and "chat.jsonl" in err
