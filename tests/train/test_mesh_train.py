"""Training on a mesh from the rules table (`k3 train --mesh ... --strategy ...`) against the single-device run.

* first-step gradients on the mesh equal the single-device ones. k3-tiny: rel-RMS per leaf within
  TOL["fp32_mesh_vs_single"] (1e-5, the issue's bound). k3-mini: its fp32 gradient is itself only that accurate —
  the one-device fp32 gradient is 1.69e-5 (worst leaf) from the float64 one, 92 of 258 leaves above 1e-5 — so two
  fp32 orders of the same sums cannot agree within 1e-5 (measured: one device over the whole batch vs one device
  summing 8 one-sequence gradients, 1.48e-5). There the check is against the float64 gradient: the mesh's error is
  no worse than the one-device fp32 error (worst leaf, median), and within max(1e-5, 2 × the one-device error) per
  leaf (two independent roundings). Figures printed and in experiments/LOG.md;
* every expert stack and its optimizer state is split 1/∏(mesh axes the rules assign) per device, read from
  ``addressable_shards`` (1/4 under ep on data 2 × expert 4, 1/8 under fsdp_ep_tp on fsdp 2 × expert 2 × tensor 2);
* 20-step loss curves: steps 1-5 within 1e-5 of the single-device curve, the whole curve within the one-device
  run's own reproducibility (the issue's 1e-3 is below it; see the test);
* the k3-mini cases are marked ``manual`` (CI's budget; `bash scripts/test.sh -m manual`), the k3-tiny one slow;
* a sharded checkpoint restores onto a different mesh shape bit-identically (slow);
* bad meshes / strategies exit 2 before anything is initialised.

k3-tiny (vocab 97, 3 KDA heads) cannot take a tensor axis; the fsdp_ep_tp cases run on k3-mini.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.cli.main import main
from k3jax.pytree import key_names, path_str
from k3jax.testing import TOL, rel_rms
from k3jax.train import data as tdata
from k3jax.train.loop import build, train
from k3jax.train.settings import TrainConfig
from k3jax.train.step import make_loss

TINY = TrainConfig(preset="k3-tiny", steps=1, batch=8, seq_len=16, max_bytes=100_000, eval_every=1000,
                   progress=False, peak_flops=1e12)
MINI = TINY.replace(preset="k3-mini", seq_len=32)


def _first_grads(tc: TrainConfig, parts: int = 1):
    """Gradients of the first micro-batch's loss at the initial parameters, computed on ``tc``'s mesh; with
    ``parts`` > 1 (one device) the mean of the gradients of ``parts`` equal slices of the batch."""
    from k3jax.sharding.placement import batch_sharding
    from k3jax.train.settings import step_spec

    run = build(tc, log=lambda m: None)
    tokens = tdata.batch_at(run.train_toks, seed=tc.seed, step=0, batch=tc.batch, seq_len=tc.seq_len,
                            vocab=run.vocab)
    loss = make_loss(run.cfg, run.settings, step_spec(tc), run.dispatch)
    grad = jax.grad(lambda p, t: loss(p, t)[0])
    if parts > 1:
        whole = grad
        grad = lambda p, t: jax.tree.map(lambda g: jnp.mean(g, 0),  # noqa: E731
                                         jax.lax.map(lambda x: whole(p, x), t.reshape(parts, -1, t.shape[-1])))
    bsh = batch_sharding(run.strategy, run.mesh, 2)
    g = jax.jit(grad, in_shardings=(run.state_sh["params"], bsh),
                out_shardings=run.state_sh["params"])(run.state["params"], jax.device_put(tokens, bsh))
    return run, g


def _worst(g, g_ref) -> tuple[float, str]:
    ref = dict(jax.tree_util.tree_leaves_with_path(g_ref))
    return max((rel_rms(np.asarray(x), np.asarray(ref[p])), path_str(p)) for p, x in
               jax.tree_util.tree_leaves_with_path(g))


def _compare_grads(g_mesh, single: dict, parts: int) -> str:
    """Assert the mesh gradients equal the one-device gradients over the same batch partition; return a line with
    the worst gaps (also to the whole-batch one-device gradient, and that one's own gap to the partitioned one)."""
    ref = dict(jax.tree_util.tree_leaves_with_path(single[parts]))
    for path, x in jax.tree_util.tree_leaves_with_path(g_mesh):
        e = rel_rms(np.asarray(x), np.asarray(ref[path]))
        assert e <= TOL["fp32_mesh_vs_single"], f"{path_str(path)}: rel-RMS {e:.2e}"
    w, name = _worst(g_mesh, single[parts])
    wf, namef = _worst(g_mesh, single[1])
    floor, namefl = _worst(single[parts], single[1])
    return (f"worst rel-RMS {w:.2e} ({name}) vs one device over the same {parts} parts; {wf:.2e} ({namef}) vs the "
            f"whole batch on one device, whose gap to the {parts}-part one-device gradient is {floor:.2e} ({namefl})")


def _expert_leaves(tree):
    """(path, array) of the routed-expert stacks in a params or optimizer-state tree."""
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        names = key_names(path)
        if "experts" in names and x.ndim >= 3:
            out.append((path_str(path), x))
    return out


def _check_fraction(run, frac: int) -> int:
    """Every expert stack and each of its optimizer moments: each device holds exactly 1/frac of it."""
    n = 0
    for tree in (run.state["params"], run.state["opt"]):
        leaves = _expert_leaves(tree)
        assert leaves
        for name, x in leaves:
            shards = x.addressable_shards
            assert len(shards) == run.mesh.devices.size
            for s in shards:
                assert s.data.size * frac == x.size, f"{name}: device {s.device} holds {s.data.size}/{x.size}"
            n += 1
    return n


@pytest.fixture(scope="module")
def tiny_single():
    return {n: _first_grads(TINY.replace(devices=1), n)[1] for n in (1, 8)}


@pytest.mark.slow  # k3-tiny gradient compiles, on one device and on 8 (~1-4 min each on 2 cores)
@pytest.mark.parametrize("mesh, strategy, frac", [("data=2,expert=4", "ep", 4), ("fsdp=2,expert=4", "zero3_ep_tp", 8)])
def test_ep_first_step_gradients_and_expert_shards_k3_tiny(mesh, strategy, frac, tiny_single):
    """zero3_ep_tp also splits every non-expert weight over fsdp x expert (the full model's QAT layout)."""
    run, g = _first_grads(TINY.replace(mesh=mesh, strategy=strategy))
    assert run.strategy == strategy and run.dispatch is not None
    line = _compare_grads(g, tiny_single, 8)
    n = _check_fraction(run, frac)
    if strategy == "zero3_ep_tp":
        q = run.state["params"]["pre"][0]["kda"]["wq"]  # [embed, heads, head_dim]: embed over fsdp x expert
        assert all(s.data.size * 8 == q.size for s in q.addressable_shards)
    print(f"\nk3-tiny {strategy}: {line}; {n} expert stacks / moments at 1/{frac} per device")


@pytest.mark.manual  # four k3-mini gradient compiles (one float64, two on 8 devices): ~8 CPU-minutes
@pytest.mark.parametrize("mesh, strategy, frac", [("data=2,expert=4", "ep", 4),
                                                  ("fsdp=2,expert=2,tensor=2", "fsdp_ep_tp", 8)])
def test_first_step_gradients_and_expert_shards_k3_mini(mesh, strategy, frac, mini_single):
    run, g = _first_grads(MINI.replace(mesh=mesh, strategy=strategy))
    g64, g32 = mini_single
    err = {path_str(p): rel_rms(np.asarray(x), np.asarray(g64[path_str(p)]))
           for p, x in jax.tree_util.tree_leaves_with_path(g)}
    err32 = {path_str(p): rel_rms(np.asarray(x), np.asarray(g64[path_str(p)]))
             for p, x in jax.tree_util.tree_leaves_with_path(g32)}
    gap = _worst(g, g32)
    for k, e in err.items():
        assert e <= max(TOL["fp32_mesh_vs_single"], 2 * err32[k]), \
            f"{k}: {e:.2e} from float64 (one device {err32[k]:.2e})"
    assert max(err.values()) <= max(err32.values()) and np.median(list(err.values())) <= np.median(list(err32.values()))
    n = _check_fraction(run, frac)
    print(f"\nk3-mini {strategy}: error vs float64 worst {max(err.values()):.2e} / median "
          f"{np.median(list(err.values())):.2e} (one device fp32: {max(err32.values()):.2e} / "
          f"{np.median(list(err32.values())):.2e}); gap to one device fp32 {gap[0]:.2e} ({gap[1]}); "
          f"{n} expert stacks / moments at 1/{frac} per device")


@pytest.fixture(scope="module")
def mini_single():
    """(float64 gradients by leaf name, one-device fp32 gradients) of k3-mini's first batch."""
    from k3jax.config import default_run
    from k3jax.train.settings import step_spec

    run, g32 = _first_grads(MINI.replace(devices=1))
    tokens = tdata.batch_at(run.train_toks, seed=MINI.seed, step=0, batch=MINI.batch, seq_len=MINI.seq_len,
                            vocab=run.vocab)
    s64 = default_run(run.cfg, qat="off", compute_dtype="float64", param_dtype="float64")
    loss = make_loss(run.cfg, s64, step_spec(MINI), None)
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        p64 = jax.tree.map(lambda x: np.asarray(x).astype(np.float64), run.state["params"])
        g64 = jax.jit(jax.grad(lambda p, t: loss(p, t)[0]))(p64, tokens)
        g64 = {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(g64)}
    finally:
        jax.config.update("jax_enable_x64", prev)
    return g64, g32


CURVE = MINI.replace(steps=20, batch=8, seq_len=32)


@pytest.fixture(scope="module")
def mini_curve_single():
    """The one-device curve and the one-device curve with the same batch accumulated in two halves."""
    return (np.asarray(train(CURVE.replace(devices=1), log=lambda m: None)["losses"]),
            np.asarray(train(CURVE.replace(devices=1, micro_batches=2), log=lambda m: None)["losses"]))


@pytest.mark.manual  # four k3-mini training runs (two on 1 device, two on 8): ~15 CPU-minutes
# Measured (session 9, experiments/LOG.md): k3-mini training amplifies any float32 rounding difference. One device
# against itself with the batch summed in two halves (micro_batches=2, a ~1e-7 change in the gradient) drifts 9.3e-3
# within 20 steps; ep drifts 9.5e-3 (fsdp_ep_tp 1.1e-2 in session 8). Steps 1-5 agree within 6e-7 on both; the drift
# starts when a QB bias update crosses a histogram bin (a discrete jump) and AdamW's normalised steps on the
# near-zero AttnRes queries magnify the difference. The same state stepped once on the mesh and on one device
# differs by <= 2.3e-5 on the worst leaf (an AdamW leaf with near-zero gradients, step 2), ~1e-6 at steps 3-6, so the
# sharded update is exact to rounding. The 1e-3 on
# the whole curve is below the one-device run's own reproducibility: the test checks the pre-amplification steps
# tightly and the curve against that floor.
@pytest.mark.parametrize("mesh, strategy", [("data=2,expert=4", "ep"), ("fsdp=2,expert=2,tensor=2", "fsdp_ep_tp")])
def test_20_step_loss_curve_matches_single_device(mesh, strategy, mini_curve_single, tmp_path):
    m = tmp_path / "m.jsonl"
    losses = train(CURVE.replace(mesh=mesh, strategy=strategy, metrics=str(m)), log=lambda m: None)["losses"]
    ref, halves = mini_curve_single
    gap = np.abs(np.asarray(losses) - ref) / np.abs(ref)
    floor = np.abs(halves - ref) / np.abs(ref)
    print(f"\nk3-mini {strategy}: 20-step loss curve max relative gap {gap.max():.2e} (steps 1-5: {gap[:5].max():.1e});"
          f" one device vs itself with the batch in two halves: {floor.max():.2e} (steps 1-5: {floor[:5].max():.1e})")
    assert len(losses) == 20
    assert gap[:5].max() <= 1e-5
    assert gap.max() <= max(1e-3, 3 * floor.max())
    start = json.loads(open(m).readline())
    assert start["strategy"] == strategy and start["devices"] == 8
    assert start["param_bytes_per_device"] > 0 and start["opt_state_bytes_per_device"] > 0


@pytest.mark.slow
def test_sharded_checkpoint_restores_onto_another_mesh_bit_identically(tmp_path):
    from k3jax.train.ckpt import manager, restore_state

    ck = str(tmp_path / "ck")
    tc = TINY.replace(steps=2, mesh="data=2,expert=4", ckpt_dir=ck, ckpt_every=1, async_ckpt=False)
    s = train(tc, log=lambda m: None)
    saved = build(tc, log=lambda m: None)  # a fresh run on the writing mesh, restored
    mngr = manager(ck, keep=3, async_save=False)
    on_same, _ = restore_state(mngr, saved.state)
    other = build(tc.replace(mesh="data=4,expert=2"), log=lambda m: None)
    on_other, _ = restore_state(mngr, other.state)
    mngr.close()
    for path, x in jax.tree_util.tree_leaves_with_path(on_other):
        assert x.sharding.mesh.shape["expert"] == 2, path_str(path)
    a, b = jax.tree.leaves(on_same), jax.tree.leaves(on_other)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(s["params"]), jax.tree.leaves(on_other["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("argv, msg", [
    (["--preset", "k3-tiny", "--mesh", "tensor=2,expert=4"], "logical axis 'vocab', size 97"),
    (["--preset", "k3-tiny", "--mesh", "expert=3"], "logical axis 'experts'"),
    (["--preset", "k3-tiny", "--mesh", "data=2,expert=4", "--strategy", "zero3"], "--strategy 'zero3': unknown"),
    (["--preset", "k3-tiny", "--mesh", "data=16"], "needs 16 devices, 8 available"),
    (["--preset", "k3-tiny", "--mesh", "data=2,experts=4"], "unknown mesh axes ['experts']"),
    (["--preset", "k3-tiny", "--mesh", "data=two"], "expected axis=size pairs"),
    (["--preset", "k3-tiny", "--mesh", "data=2", "--devices", "2"], "give --mesh or --devices, not both"),
    (["--preset", "k3-tiny", "--strategy", "ep"], "--strategy needs --mesh"),
    (["--preset", "k3-tiny", "--mesh", "data=2,expert=4", "--batch", "4"], "not divisible by the 8 ways"),
], ids=["vocab-tensor", "experts-3", "strategy", "devices", "axis-name", "axis-size", "mesh-and-devices",
        "strategy-alone", "batch"])
def test_bad_mesh_input_exits_2_before_compute(argv, msg, capsys, monkeypatch):
    import k3jax.train.loop as loop_mod

    def boom(*a, **k):
        raise AssertionError("initialised parameters despite bad input")

    monkeypatch.setattr(loop_mod, "initial_params", boom)
    rc = main(["train", *argv, "--steps", "1", "--seq-len", "16", "--max-bytes", "100000", "--no-progress"])
    assert rc == 2
    assert msg in capsys.readouterr().err
