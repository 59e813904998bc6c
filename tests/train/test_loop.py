"""Train loop on k3-tiny: exact resume, NaN/Inf skipping and stopping, bad input before any compute.

The SIGKILL / SIGTERM process-level checks are in test_kill_resume.py (slow)."""

import json

import jax
import numpy as np
import pytest

from k3jax.cli.main import main
from k3jax.errors import InputError
from k3jax.pytree import path_str
from k3jax.train.ckpt import load_checkpoint_params
from k3jax.train.loop import TrainingStoppedError, train
from k3jax.train.settings import TrainConfig, resume_diff

BASE = TrainConfig(preset="k3-tiny", steps=4, batch=4, micro_batches=2, seq_len=16, lr=3e-3, eval_every=100,
                   eval_windows=4, max_bytes=100_000, devices=2, progress=False, peak_flops=1e9)


def _by_path(tree) -> dict:
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_trees_equal(a, b):
    """Same leaves under the same key paths, compared as text: orbax checkpoints hold integer dict keys as str."""
    fa, fb = _by_path(a), _by_path(b)
    assert fa.keys() == fb.keys()
    for k, x in fa.items():
        np.testing.assert_array_equal(x, fb[k], err_msg=k)


@pytest.mark.slow  # three compiles of the k3-tiny step (~2-8 min on 2 cores); test_kill_resume.py covers SIGKILL
def test_resume_is_bit_identical_and_qb_bias_moves(tmp_path):
    full = train(BASE.replace(ckpt_dir=str(tmp_path / "a"), metrics=str(tmp_path / "a.jsonl")))
    # "crash" after step 2 (only the step-2 checkpoint exists), then resume with the same command
    part = BASE.replace(ckpt_dir=str(tmp_path / "b"), ckpt_every=2, total_steps=4)
    train(part.replace(steps=2))
    resumed = train(part)
    assert resumed["start_step"] == 2
    _assert_trees_equal(full["params"], resumed["params"])
    step, saved = load_checkpoint_params(str(tmp_path / "a"))
    assert step == 4
    _assert_trees_equal(full["params"], saved)
    bias = np.asarray(full["params"]["pre"][1]["moe"]["bias"])  # layer 1 (unstacked)
    assert np.any(bias != 0) and abs(bias.mean()) < 1e-6  # QB moved (and centred) the frozen-to-optax bias
    recs = [json.loads(x) for x in open(tmp_path / "a.jsonl")]
    steps = [r for r in recs if "step" in r and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "tokens_per_s", "mfu", "load_max_over_mean", "qb_bias_range", "qk_clip_events"):
        assert key in steps[0], key
    assert len(steps[0]["load_max_over_mean"]) == 4  # k3-tiny: layers 1-4 are MoE
    assert "eval_loss" in steps[-1] and np.isfinite(steps[-1]["eval_loss"])


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_stop_with_last_good_checkpoint(tmp_path):
    ck = str(tmp_path / "ck")
    tc = BASE.replace(steps=6, ckpt_dir=ck, ckpt_every=1, keep=10, poison_steps=(2, 4, 5), max_bad_steps=2,
                      metrics=str(tmp_path / "m.jsonl"), async_ckpt=False)
    with pytest.raises(TrainingStoppedError, match=r"stopped at step 5: 2 non-finite steps in a row .*step 3") as ei:
        train(tc)
    s = ei.value.summary
    assert s["skipped_steps"] == [2, 4, 5]
    last, saved = load_checkpoint_params(ck)
    assert last == 3  # the bad steps wrote nothing; the last good checkpoint is intact
    _assert_trees_equal(s["params"], saved)  # skipped steps 4 and 5 left every parameter (and QB bias) unchanged
    recs = [json.loads(x) for x in open(tmp_path / "m.jsonl") if '"finite"' in x]
    assert [r["finite"] for r in recs] == [True, False, True, False, False]


@pytest.mark.parametrize("argv, msg", [
    (["--preset", "nope"], "unknown preset"),
    (["--preset", "k3-tiny", "--steps", "0"], "--steps must be >= 1"),
    (["--preset", "k3-tiny", "--batch", "6", "--micro-batches", "4"], "not divisible by --micro-batches"),
    (["--preset", "k3-tiny", "--batch", "6", "--micro-batches", "2", "--devices", "2"], "not divisible by the 2"),
    (["--preset", "k3-tiny", "--data", "EMPTY"], "corpus is empty"),
    (["--preset", "k3-tiny", "--data", "MISSING"], "no such file"),
    (["--preset", "k3-tiny", "--data", "BADJSONL"], "not JSON"),
    (["--preset", "k3-mini", "--init", "TINYCKPT"], "does not match --preset k3-mini"),
    (["--init", "NOCKPT"], "no config.json"),
    (["--preset", "k3-tiny", "--qb-ema", "1.0"], "--qb-ema must lie in [0, 1)"),
    (["--preset", "k3-tiny", "--opt-state-dtype", "int8"], "--opt-state-dtype 'int8'"),
    (["--preset", "k3-tiny", "--lr", "-1"], "--lr must be > 0, got -1"),
    (["--preset", "k3-tiny", "--qk-tau", "0"], "--qk-tau must be > 0"),
    (["--preset", "k3-tiny", "--keep", "0"], "--keep must be >= 1, got 0"),
    (["--preset", "k3-tiny", "--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--preset", "k3-tiny", "--log-every", "-1"], "--log-every must be >= 0"),
], ids=["preset", "steps", "micro", "mesh", "empty", "missing", "jsonl", "init-mismatch", "init-missing", "qb-ema",
        "opt-state-dtype", "lr", "qk-tau", "keep", "seq-len", "log-every"])
def test_bad_input_exits_2_before_compute(argv, msg, tmp_path, capsys, monkeypatch):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (tmp_path / "nock").mkdir()
    tiny = tmp_path / "tiny"
    if "TINYCKPT" in argv:
        from k3jax.checkpoint import save
        from k3jax.config import get_preset
        from k3jax.model import init_params
        cfg = get_preset("k3-tiny")
        save(init_params(cfg, jax.random.key(0)), cfg, tiny)
    subst = {"EMPTY": str(tmp_path / "empty.txt"), "MISSING": str(tmp_path / "missing.txt"),
             "BADJSONL": str(tmp_path / "bad.jsonl"), "TINYCKPT": str(tiny), "NOCKPT": str(tmp_path / "nock")}
    import k3jax.train.loop as loop_mod

    def boom(*a, **k):
        raise AssertionError("initialised parameters despite bad input")

    monkeypatch.setattr(loop_mod, "initial_params", boom)
    rc = main(["train", *[subst.get(a, a) for a in argv], "--no-progress"])
    assert rc == 2
    assert msg in capsys.readouterr().err


def test_resume_diff_defaults_keys_older_checkpoints_lack():
    now = TrainConfig(preset="k3-tiny", steps=5).resume_key()
    old = {k: v for k, v in now.items() if k != "qb_ema"}  # written before qb_ema existed
    assert resume_diff(old, now) == []
    assert resume_diff(old, TrainConfig(preset="k3-tiny", steps=5, qb_ema=0.5).resume_key()) == ["qb_ema"]
    assert resume_diff(dict(now, lr=1.0), now) == ["lr"]


def test_muon_layout_resolves_by_device_count_and_older_checkpoints_ran_per_layer():
    from k3jax.train.settings import resolve_muon_layout

    tc = TrainConfig(preset="k3-tiny")
    assert resolve_muon_layout(tc, 1).muon_layout == "layer" and resolve_muon_layout(tc, 8).muon_layout == "owner"
    assert resolve_muon_layout(tc.replace(muon_layout="layer"), 8).muon_layout == "layer"
    with pytest.raises(InputError, match="--muon-layout 'sideways'"):
        resolve_muon_layout(tc.replace(muon_layout="sideways"), 8)
    now = resolve_muon_layout(tc, 8).resume_key()
    old = {k: v for k, v in now.items() if k != "muon_layout"}  # every run before the key: per-layer Newton–Schulz
    assert resume_diff(old, now) == ["muon_layout"]
    assert resume_diff(old, resolve_muon_layout(tc, 1).resume_key()) == []


def test_data_mesh_comes_from_make_mesh_and_places_like_a_plain_data_mesh():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from k3jax.sharding import MESH_AXES
    from k3jax.train.settings import make_data_mesh

    mesh = make_data_mesh(2)
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    plain = Mesh(np.array(jax.devices()[:2]), ("data",))
    for spec, ndim in ((P(), 2), (P("data"), 2), (P(None, "data"), 3)):  # params, eval windows, [M, b, T+1] batches
        assert NamedSharding(mesh, spec).is_equivalent_to(NamedSharding(plain, spec), ndim)
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"--devices {n + 1}: {n} device"):
        make_data_mesh(n + 1)
