"""Training a draft for a frozen target (k3jax/draft/train.py, `k3 train --draft-for`): the objective against a
float64 NumPy transcription of it over the float64 reference draft (k3jax/reference/draft.py), the anchor draw, the
command's refusals, and a short run on k3-tiny whose held-out loss falls and whose export ``load_draft`` reads back
with the target's identity (Kimi-Linear, no AttnRes, in the slow pass)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.cli.main import main
from k3jax.config import from_hf, get_preset
from k3jax.draft import DraftConfig, DraftMismatchError
from k3jax.draft.config import target_hash
from k3jax.draft.io import load_draft
from k3jax.draft.train import anchor_mask, draft_graphdef, draft_loss, sample_anchors
from k3jax.reference.draft import train_logits_ref

KIMI_LINEAR = os.path.join(os.path.dirname(__file__), "..", "golden", "kimi_linear", "ckpt")
# a 3-token block over a 2-layer draft of k3-tiny: every loop of the objective runs more than once
DCFG = DraftConfig.for_target(get_preset("k3-tiny"), num_layers=2, num_heads=2, block_size=3)


def _random_draft(dcfg, seed=0):
    """NumPy float64 weights of a draft: matrices N(0, 0.08^2), gains 1 + N(0, 0.1^2), the confidence head O(1)."""
    shapes = _abstract(dcfg)
    rng = np.random.default_rng(seed)

    def draw(path, s):
        if jax.tree_util.keystr(path) in ("['conf_w']", "['conf_b']"):
            return rng.standard_normal(s.shape) / np.sqrt(s.shape[0])
        return 0.08 * rng.standard_normal(s.shape) if len(s.shape) >= 2 else 1 + 0.1 * rng.standard_normal(s.shape)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _abstract(dcfg):
    from flax import nnx

    from k3jax.draft.network import DraftModel
    return nnx.state(nnx.eval_shape(lambda: DraftModel(dcfg, rngs=nnx.Rngs(0))), nnx.Param).to_pure_dict()


def _objective_ref(logits, conf, tl, anchors, ok, weights, K, gamma, conf_weight):
    """The objective as k3jax/draft/train.py's docstring states it, in float64 loops: (loss, accepted, blocks)."""
    def log_softmax(z):
        z = z - z.max()
        return z - np.log(np.exp(z).sum())

    num = den = bce = n = accepted = blocks = 0.0
    B, A = anchors.shape
    T = weights.shape[1]
    for b in range(B):
        for a in range(A):
            if not ok[b, a]:
                continue
            P, lead, run = int(anchors[b, a]), 0, True
            for i in range(1, K + 1):
                t = P + i - 1                      # the target's logits at P + i - 1 predict the token at P + i
                if t > T - 1 or not np.all(weights[b, P:t + 1] > 0):
                    break
                lp, lq = log_softmax(tl[b, t]), log_softmax(logits[b, a, i - 1])
                w = np.exp(-(i - 1) / gamma)
                num += w * -(np.exp(lp) * lq).sum()
                den += w
                y = float(np.argmax(logits[b, a, i - 1]) == np.argmax(tl[b, t]))
                c = conf[b, a, i - 1]
                bce += -(y * np.log(c) + (1 - y) * np.log(1 - c))
                n += 1
                run = run and y == 1
                lead += run
            else:
                accepted += lead                   # blocks whose K slots all count
                blocks += 1
    return num / den + conf_weight * bce / n, accepted, blocks


def test_objective_matches_float64_numpy():
    rng = np.random.default_rng(3)
    B, T, W, K = 2, 12, DCFG.vocab_size, DCFG.block_size
    params = _random_draft(DCFG)
    taps = rng.standard_normal((B, T, DCFG.num_target_layers, DCFG.hidden_size))
    tokens = rng.integers(0, W, (B, T)).astype(np.int32)
    embed, head = rng.standard_normal((W, DCFG.hidden_size)), 0.3 * rng.standard_normal((DCFG.hidden_size, W))
    tl = 3.0 * rng.standard_normal((B, T, W))
    seg = np.zeros((B, T), np.int32)
    seg[1, 7:] = 1                                  # row 1: a second document from position 7
    weights = (seg[:, 1:] == seg[:, :-1]).astype(np.float32)
    weights = np.concatenate([weights, np.ones((B, 1), np.float32)], axis=1)
    weights[0, 4] = 0.0                             # row 0: the prediction 4 -> 5 does not count
    # row 0: 3 is cut by the weight at 4, 11 is not drawn (ok False); row 1: 5 is cut at its document's end, 10 by
    # the row's end; 1, 9 (slots up to the last position) and 2, 7 (the second document's first anchor) are whole
    anchors = np.array([[1, 3, 9, 11], [2, 5, 7, 10]], np.int32)
    ok = np.array([[True, True, True, False], [True, True, True, True]])
    ref_logits, ref_conf = zip(*(train_logits_ref(params, DCFG, taps[b], tokens[b], anchors[b], embed, head,
                                                  segment_ids=seg[b]) for b in range(B)), strict=True)
    want, acc, blocks = _objective_ref(np.stack(ref_logits), np.stack(ref_conf), tl, anchors, ok, weights, K,
                                       gamma=4.0, conf_weight=0.1)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    loss, terms = jax.jit(lambda p, *a: draft_loss(p, *a, graphdef=draft_graphdef(DCFG), embed=f32(embed),
                                                   head=f32(head), weights=f32(weights), segment_ids=seg,
                                                   anchor_ok=ok))(jax.tree.map(f32, params), f32(taps), f32(tl),
                                                                  tokens, anchors)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    assert (float(terms["accepted"]), float(terms["blocks"])) == (acc, blocks)
    assert blocks == 4


def test_anchors_are_distinct_valid_positions():
    B, T, A = 3, 16, 5
    w = np.ones((B, T), np.float32)
    w[1, :12] = 0.0                                 # row 1: valid anchors 12..15 only (4 < A)
    seg = np.zeros((B, T + 1), np.int32)
    seg[2, 6:] = 1                                  # row 2: position 6 starts a document: not an anchor
    valid = np.asarray(anchor_mask(jnp.asarray(w), jnp.asarray(seg)))
    assert not valid[:, 0].any() and not valid[2, 6] and valid[1].sum() == 4
    seen = np.zeros((B, T))
    for s in range(40):
        anchors, ok = (np.asarray(x) for x in sample_anchors(jax.random.key(s), jnp.asarray(valid), A))
        assert ok.sum(1).tolist() == [A, 4, A]
        for b in range(B):
            got = anchors[b][ok[b]]
            assert valid[b, got].all() and len(set(got.tolist())) == len(got) and np.all(np.diff(got) > 0)
            seen[b, got] += 1
    assert (seen[valid] > 0).all()                  # every valid position gets drawn


@pytest.mark.parametrize("flags, named", [
    (["--qat", "weights"], "--qat"),
    (["--lora", "rank=4"], "--lora"),
    (["--preset", "k3-tiny"], "--preset"),
    (["--mesh", "data=1"], "--mesh"),
    (["--ckpt-dir", "/tmp/x"], "--ckpt-dir"),
    (["--optimizer", "per_head"], "--optimizer"),
    (["--no-qk-clip"], "--no-qk-clip"),
    (["--draft-tokens", "0"], "--draft-tokens"),
    (["--init", KIMI_LINEAR, "--draft-layers", "2"], "--draft-layers"),
])
def test_flags_a_draft_run_does_not_use_exit_2(flags, named, capsys):
    assert main(["train", "--draft-for", KIMI_LINEAR, "--steps", "2", *flags]) == 2
    assert named in capsys.readouterr().err


def test_draft_flags_need_draft_for(capsys):
    assert main(["train", "--preset", "k3-tiny", "--draft-layers", "2"]) == 2
    assert "--draft-layers needs --draft-for" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A k3-tiny checkpoint (MXFP4 experts, weights large enough for peaked next-token distributions)."""
    from k3jax.checkpoint.save import save
    from k3jax.testing import random_params

    d = tmp_path_factory.mktemp("target") / "ckpt"
    cfg = get_preset("k3-tiny")
    save(random_params(cfg, seed=5, std=0.2), cfg, d)
    return str(d)


def _run(target, out, metrics, *extra):
    return main(["train", "--draft-for", target, "--steps", "6", "--batch", "2", "--seq-len", "16", "--lr", "1e-2",
                 "--max-bytes", "100000", "--eval-at-start", "--metrics", str(metrics), "--export", str(out), *extra])


def test_cli_trains_a_draft_that_loads_back_for_its_target(tiny_target, tmp_path, capsys):
    assert _run(tiny_target, tmp_path / "draft", tmp_path / "m.jsonl") == 0
    recs = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    first, last = recs[1], recs[-1]                 # the step-0 evaluation, then the last step with its evaluation
    assert first["event"] == "eval" and last["step"] == 6
    assert last["eval_loss"] < first["eval_loss"] - 0.1 and last["eval_kl"] < first["eval_kl"]
    assert all(np.isfinite(r["loss"]) for r in recs if "loss" in r)
    assert "eval_accept_len" in last and len(last["eval_slot_acc"]) == 7
    cfg = from_hf(os.path.join(tiny_target, "config.json"))
    model, dcfg = load_draft(tmp_path / "draft", target_cfg=cfg)
    assert dcfg.target_config_hash == target_hash(cfg) and dcfg == DraftConfig.for_target(cfg)
    assert "greedy accepted" in capsys.readouterr().out
    with pytest.raises(DraftMismatchError):
        load_draft(tmp_path / "draft", target_cfg=get_preset("kimi-linear-tiny"))


@pytest.mark.slow
def test_kimi_linear_target_and_init_from_a_draft(tmp_path):
    assert _run(KIMI_LINEAR, tmp_path / "a", tmp_path / "a.jsonl", "--draft-layers", "2", "--draft-tokens", "4") == 0
    assert _run(KIMI_LINEAR, tmp_path / "b", tmp_path / "b.jsonl", "--init", str(tmp_path / "a")) == 0
    a = [json.loads(line) for line in open(tmp_path / "a.jsonl")]
    b = [json.loads(line) for line in open(tmp_path / "b.jsonl")]
    assert b[1]["eval_loss"] == pytest.approx(a[-1]["eval_loss"], rel=1e-5)   # --init continues from the export
    cfg = from_hf(os.path.join(KIMI_LINEAR, "config.json"))
    _, dcfg = load_draft(tmp_path / "b", target_cfg=cfg)
    assert (dcfg.num_hidden_layers, dcfg.block_size) == (2, 4)


@pytest.mark.slow
def test_a_dense_target_scores_as_the_packed_one(tiny_target, tmp_path):
    """--target-dense runs the target's MXFP4 experts dequantized: the same values, so the same step-0 evaluation."""
    for name, extra in (("packed", []), ("dense", ["--target-dense"])):
        assert _run(tiny_target, tmp_path / name, tmp_path / f"{name}.jsonl", "--steps", "1", *extra) == 0
    packed, dense = ([json.loads(line) for line in open(tmp_path / f"{n}.jsonl")][1] for n in ("packed", "dense"))
    assert dense["eval_loss"] == pytest.approx(packed["eval_loss"], rel=1e-5)
    assert dense["eval_accept_len"] == packed["eval_accept_len"]
