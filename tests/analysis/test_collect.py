"""Routing collection: exact loads from the model's own routing, agreement with the float64 reference model,
mesh == single device, static router analysis byte counts, and `k3 route` bad input."""

import functools
import json
import os

import jax
import numpy as np
import pytest

from k3jax.analysis import collect as ac
from k3jax.analysis.static import static_router_analysis
from k3jax.checkpoint.load import load
from k3jax.checkpoint.save import save
from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.model import forward, layer_view, restack, unstack
from k3jax.reference.model import ref_forward
from k3jax.sharding.mesh import make_mesh
from k3jax.testing import random_params

CFG = get_preset("k3-tiny")  # 5 layers, MoE at 1..4, 8 experts top-2, vocab 97
SEQ, BATCH = 16, 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("route") / "tiny"
    save(random_params(CFG, seed=5, std=0.2), CFG, d)  # std 0.2: routing far from uniform ties
    return str(d)


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load(ckpt, progress=False)


def stream(n=150, seed=0):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).astype(np.int32)


@functools.cache
def forward_ids(cfg):
    """Jitted once per config: the expert ids [B, T, k] of each MoE layer from ``forward(..., return_aux=True)``."""
    return jax.jit(lambda p, t: [r.ids for r in forward(p, t, cfg, return_aux=True)[1]["routing"]])


def forward_loads(params, cfg, tokens, mask):
    """{layer: bincount of the expert ids the model's forward over ``tokens`` [B, T] routes, at ``mask``}."""
    ids = forward_ids(cfg)(params, tokens)
    return {l: np.bincount(np.asarray(ids[i])[mask].reshape(-1), minlength=CFG.num_experts)
            for i, l in enumerate((1, 2, 3, 4))}


@pytest.mark.parametrize("pad", [0, 11], ids=["full", "ragged"])
def test_route_json_loads_equal_bincount_of_forward_routing(ckpt, loaded, tmp_path, capsys, pad):
    """A [2, 32] --tokens file is a batch of 2 sequences: the loads are the bincount of the expert ids the model's
    own forward over those two rows routes; ragged (row 1 right-padded with -1): over the real positions of the
    forward over the rows (padding as id 0), the padding in no statistic."""
    cfg, params = loaded
    rows = stream(64).reshape(2, 32)
    rows[1, 32 - pad:] = -1
    mask = rows >= 0
    np.save(tmp_path / "t.npy", rows)
    capsys.readouterr()
    assert main(["route", "--ckpt", ckpt, "--tokens", str(tmp_path / "t.npy"), "--batch", "2", "--json"]) == 0
    io = capsys.readouterr()
    rep = json.loads(io.out)
    assert rep["tokens"] == mask.sum() and [d["layer"] for d in rep["layers"]] == [1, 2, 3, 4]
    assert "--seq-len" not in io.err                    # 32 <= --seq-len 128: each row routed whole
    want = forward_loads(params, cfg, np.where(mask, rows, 0), mask)
    for d in rep["layers"]:
        assert d["load"] == want[d["layer"]].tolist() and sum(d["load"]) == mask.sum() * CFG.num_experts_per_token
        for k in ("max_over_mean_load", "load_cv", "load_entropy_bits", "experts_unused", "maxvio"):
            assert k in d


def test_route_windows_a_row_longer_than_seq_len(ckpt, loaded, tmp_path, capsys):
    """Row 0 (40 tokens) > --seq-len 16: three windows (16, 16, 8), said once on stderr; row 1 (10 tokens, then
    padding) one window. The loads are those of the forward over exactly these four sequences."""
    cfg, params = loaded
    rows = stream(80, seed=3).reshape(2, 40)
    rows[1, 10:] = -1
    np.save(tmp_path / "t.npy", rows)
    capsys.readouterr()
    assert main(["route", "--ckpt", ckpt, "--tokens", str(tmp_path / "t.npy"), "--seq-len", "16", "--batch", "4",
                 "--json"]) == 0
    io = capsys.readouterr()
    assert io.err.count("longer than --seq-len") == 1 and "1 of 2 rows are longer than --seq-len 16" in io.err
    win = np.zeros((4, 16), np.int32)
    win[0], win[1], win[2, :8], win[3, :10] = rows[0, :16], rows[0, 16:32], rows[0, 32:], rows[1, :10]
    mask = np.zeros((4, 16), bool)
    mask[:2], mask[2, :8], mask[3, :10] = True, True, True
    rep = json.loads(io.out)
    want = forward_loads(params, cfg, win, mask)
    assert rep["tokens"] == 50 and all(d["load"] == want[d["layer"]].tolist() for d in rep["layers"])


def test_windows_of_rows_and_of_a_stream():
    """``windows``: a [T] stream keeps its consecutive --seq-len windows; [B, T] rows each start a window, are cut
    only past seq_len, run at width min(seq_len, longest row); max_tokens takes the first real ids, rows in order."""
    s = np.arange(1, 40, dtype=np.int32)
    (tok, mask), = ac.windows(s, 16, 4)
    assert tok.shape == (4, 16) and tok.reshape(-1)[:39].tolist() == s.tolist() and mask.sum() == 39
    rows = np.array([[1, 2, 3, 4, 5, -1], [6, -1, -1, -1, -1, -1], [7, 8, 9, 10, 11, 12]], np.int32)
    got = list(ac.windows(rows, 4, 3))
    assert [t.shape for t, _ in got] == [(3, 4), (3, 4)]
    tok, mask = np.concatenate([t for t, _ in got]), np.concatenate([m for _, m in got])
    assert [t[m].tolist() for t, m in zip(tok, mask)] == [[1, 2, 3, 4], [5], [6], [7, 8, 9, 10], [11, 12], []]
    assert (tok[~mask] == 0).all()
    (tok, mask), = ac.windows(rows, 8, 4, max_tokens=7)
    assert tok.shape == (4, 5) and [t[m].tolist() for t, m in zip(tok, mask)] == [[1, 2, 3, 4, 5], [6], [7], []]
    assert ac.row_lengths(rows, 7).tolist() == [5, 1, 1]
    assert ac.num_batches(rows, 4, 3) == 2 and ac.num_batches(s, 16, 1) == 3


def test_ids_equal_the_float64_reference_model(loaded, capsys):
    cfg, params = loaded
    s = stream(2 * SEQ, seed=1)
    _, _, kept = ac.collect(params, cfg, s, seq_len=SEQ, batch=2, keep=True)
    routing = {}
    ref_forward(unstack(params, cfg), s.reshape(2, SEQ), cfg, routing=routing)
    total = excused = mismatched = 0
    for l in (1, 2, 3, 4):
        got = kept[l]["ids"][kept["mask"]]
        ref = [t for seq in routing[l] for t in seq]
        for g, (ids, kth, k1th) in zip(got, ref, strict=True):
            total += len(ids)
            if sorted(g.tolist()) != sorted(ids):
                if kth - k1th < 1e-4:
                    excused += 1
                else:
                    mismatched += 1
    print(f"routing vs float64 reference: {total} assignments, {excused} tokens excused (gap < 1e-4), "
          f"{mismatched} mismatched")
    assert mismatched == 0 and excused <= 0.001 * total


def test_mesh_routing_equals_single_device(loaded):
    cfg, params = loaded
    s = stream(300, seed=2)
    one, _, k1 = ac.collect(params, cfg, s, seq_len=SEQ, batch=BATCH, keep=True)
    eight, _, k8 = ac.collect(params, cfg, s, seq_len=SEQ, batch=BATCH, keep=True, mesh=make_mesh({"data": 8}))
    assert one["tokens"] == eight["tokens"] == s.size
    for l in (1, 2, 3, 4):
        np.testing.assert_array_equal(k1[l]["ids"][k1["mask"]], k8[l]["ids"][k8["mask"]])
    assert [d["load"] for d in one["layers"]] == [d["load"] for d in eight["layers"]]


def test_compare_reports_drift(ckpt, loaded, tmp_path, capsys):
    cfg, params = loaded
    view = unstack(params, cfg)
    moe = layer_view(params, cfg, 2)["moe"]
    layers = list(view["layers"])
    layers[2] = dict(layers[2], moe=dict(moe, router=-moe["router"], bias=-moe["bias"]))  # layer 2: experts reversed
    other = restack(dict(view, layers=layers), cfg)
    d2 = tmp_path / "other"
    save(other, cfg, d2)
    s = stream()
    np.save(tmp_path / "t.npy", s)
    capsys.readouterr()
    assert main(["route", "--ckpt", ckpt, "--compare", str(d2), "--tokens", str(tmp_path / "t.npy"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    dr = {d["layer"]: d["drift"] for d in rep["layers"]}
    assert dr[1] == {"saturation": 1.0, "top1": 1.0}  # layer 1 sees identical inputs and router
    assert dr[2]["saturation"] < 0.5


def test_static_reads_only_router_and_bias_bytes(ckpt):
    r = static_router_analysis(ckpt, [1, 3])
    E, d = CFG.num_experts, CFG.hidden_size
    assert r["bytes_read"] == 2 * (E * d * 2 + E * 4)  # BF16 router + F32 bias, two layers
    assert r["shards_touched"] == 2
    from k3jax.checkpoint.container import read_header

    hb = sum(8 + read_header(os.path.join(ckpt, f)).header_len for f in ("model-00002-of-000006.safetensors",
                                                                         "model-00004-of-000006.safetensors"))
    assert r["header_bytes"] == hb
    cfg, params = load(ckpt, progress=False)
    W = np.asarray(layer_view(params, cfg, 1)["moe"]["router"], np.float64).T  # [E, d]
    np.testing.assert_allclose(r["layers"][0]["router_norm"]["mean"], np.linalg.norm(W, axis=1).mean(), rtol=1e-12)
    b = np.asarray(layer_view(params, cfg, 1)["moe"]["bias"], np.float64)
    assert r["layers"][0]["bias"]["range"] == pytest.approx(b.max() - b.min())


@pytest.mark.parametrize("argv,words", [
    (["--layers", "0"], "not MoE layers"),
    (["--layers", "7"], "not MoE layers"),
    (["--layers", "a,b"], "comma-separated integers"),
    (["--seq-len", "0"], ">= 1"),
], ids=["dense-layer", "past-end", "not-ints", "seq-len"])
def test_bad_flags_exit_2(ckpt, tmp_path, capsys, argv, words):
    np.save(tmp_path / "t.npy", stream(40))
    assert main(["route", "--ckpt", ckpt, "--tokens", str(tmp_path / "t.npy"), *argv]) == 2
    assert words in capsys.readouterr().err


def test_bad_inputs_exit_2(ckpt, tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    assert main(["route", "--ckpt", ckpt, "--text", str(tmp_path / "empty.txt")]) == 2
    assert "empty" in capsys.readouterr().err
    (tmp_path / "t.txt").write_bytes(b"hello")
    assert main(["route", "--ckpt", ckpt, "--text", str(tmp_path / "t.txt")]) == 2  # vocab 97 < 256
    assert "at least 256 ids, got 97" in capsys.readouterr().err
    other = get_preset("k3-tiny", num_experts=16)
    save(random_params(other), other, tmp_path / "wide")
    np.save(tmp_path / "t.npy", stream(40))
    assert main(["route", "--ckpt", ckpt, "--compare", str(tmp_path / "wide"), "--tokens",
                 str(tmp_path / "t.npy")]) == 2
    err = capsys.readouterr().err
    assert "different config" in err and "num_experts" in err
    # a checkpoint without router tensors: drop them from the index
    import shutil

    bad = tmp_path / "norouter"
    shutil.copytree(ckpt, bad)
    idx = json.load(open(bad / "model.safetensors.index.json"))
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if "gate.weight" not in k}
    json.dump(idx, open(bad / "model.safetensors.index.json", "w"))
    assert main(["route", "--ckpt", str(bad), "--static"]) == 2
    assert "no router tensors" in capsys.readouterr().err
