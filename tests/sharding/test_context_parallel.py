"""Context parallelism (k3jax/sharding/context_parallel.py) on 8 simulated CPU devices: the sequence split over a
``context`` axis (alone, with data, with expert) gives the one-device logits, gradients, routing, prefill cache
and decode; sequence lengths that are not a multiple of the chunk per shard, and shards shorter than one chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import default_run, get_preset
from k3jax.errors import InputError
from k3jax.model import cache as C  # noqa: N812
from k3jax.model import forward, init_params, lm_loss
from k3jax.pytree import path_str
from k3jax.sharding.context_parallel import ContextParallel, split_axes
from k3jax.sharding.mesh import make_mesh
from k3jax.sharding.placement import cache_shardings, default_strategy, expert_dispatch, resolve_mesh, small_batch
from k3jax.sharding.rules import param_shardings
from k3jax.testing import TOL, assert_close, rel_rms

# (mesh, batch, T, KDA chunk): T / shards tokens per shard — 8 (half a 16-token chunk), 10 (not a multiple of the
# chunk or of the 16-token sub-chunk), 8 under 64-token chunks (the T = 32 over context 4, chunk 64)
CASES = [
    # 8 shards of one sequence: ~72 s in the default pass, moved to slow; the B = 1 case below splits the sequence
    # 8 ways too (over context x expert)
    pytest.param({"context": 8}, 1, 64, 16, marks=pytest.mark.slow),
    ({"data": 2, "context": 4}, 2, 40, 16),
    ({"expert": 2, "context": 4}, 2, 32, 64),
    pytest.param({"expert": 2, "context": 4}, 1, 64, 16,   # B = 1: the sequence takes the expert axis too (8
                 marks=pytest.mark.slow),                 # shards); slow: CI's budget (102 s there)
]


def _setup(chunk, **kw):
    cfg = get_preset("k3-tiny")
    run = default_run(cfg, kda_chunk_size=chunk, **kw)
    return cfg, run, init_params(cfg, jax.random.key(0), run)


def _placed(cfg, shape, batch):
    mesh = make_mesh(shape)
    strategy = default_strategy(shape)
    return mesh, strategy, expert_dispatch(strategy, mesh, batch=batch)


@pytest.mark.parametrize("shape,B,T,chunk", CASES, ids=lambda v: str(v))
def test_logits_and_gradients_equal_one_device(shape, B, T, chunk):
    cfg, run, params = _setup(chunk)
    tok = jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg.vocab_size)
    mesh, strategy, d = _placed(cfg, shape, B)
    # B = 1 on expert 2 x context 4: the batch cannot use the expert axis, so the sequence takes it (8 shards)
    assert d.context.seq_axes == (("expert", "context") if "expert" in shape and B == 1 else ("context",))
    placed = jax.device_put(params, param_shardings(cfg, strategy, mesh))

    def grads(dispatch, run=run):
        return jax.jit(jax.grad(lambda p, t: lm_loss(p, t[:, :-1], t[:, 1:], cfg, run, dispatch=dispatch)))

    ref = jax.jit(lambda p, t: forward(p, t, cfg, run))(params, tok[:, :-1])
    out = jax.jit(lambda p, t: forward(p, t, cfg, run, dispatch=d))(placed, tok[:, :-1])
    assert_close(out, ref, TOL["fp32_mesh_vs_single"], name="logits")
    g1, gc = grads(None)(params, tok), grads(d)(placed, tok)
    # per leaf within the bound of the one-device fp32 gradient — or, for the few leaves where two fp32 programs that
    # round differently cannot agree that closely (the gate's A_log sums its cotangent over every token and channel
    # with cancellation: one device's fp32 is 0.9e-5 - 2.4e-5 from float64 here), as accurate as one device: within
    # max(bound, 2x one device's error) of the float64 gradient. (Exactness of the split itself:
    # test_float64_gradients_equal_one_device, 1e-10.)
    bound = TOL["fp32_mesh_vs_single"]
    flat1 = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(g1)}
    far = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(gc) if rel_rms(x, flat1[path_str(p)]) > bound}
    if far:
        run64 = run.replace(param_dtype="float64", compute_dtype="float64")
        with jax.enable_x64(True):
            g64 = grads(None, run64)(jax.tree.map(lambda x: x.astype(jnp.float64), params), tok)
        flat64 = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(g64)}
        for name, x in far.items():
            one = rel_rms(flat1[name], flat64[name])
            err = assert_close(x, flat64[name], max(bound, 2 * one), name=f"{name} vs float64")
            print(f"{name}: context parallel {err:.2e}, one device {one:.2e} from float64")
        assert len(far) <= 3, sorted(far)


def test_float64_gradients_equal_one_device(x64):
    """In float64 the split is exact to rounding: every leaf within 1e-10 (the fp32 test's bound is rounding)."""
    cfg, run, params = _setup(16, param_dtype="float64", compute_dtype="float64")
    tok = jax.random.randint(jax.random.key(2), (2, 41), 0, cfg.vocab_size)
    mesh, strategy, d = _placed(cfg, {"data": 2, "context": 4}, 2)
    placed = jax.device_put(params, param_shardings(cfg, strategy, mesh))
    grad = lambda dispatch: jax.jit(jax.grad(  # noqa: E731
        lambda p, t: lm_loss(p, t[:, :-1], t[:, 1:], cfg, run, dispatch=dispatch)))
    g1, gc = grad(None)(params, tok), grad(d)(placed, tok)
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(gc), jax.tree.leaves(g1), strict=True):
        assert_close(a, b, 1e-10, atol_floor=1e-15, name=path_str(p))


@pytest.mark.parametrize("combine", ["ppermute", pytest.param("gather", marks=pytest.mark.slow)])  # CI's budget
def test_scanned_stack_remat_and_packed_documents(combine):
    """The scanned stack under remat, packed documents whose boundaries fall inside and exactly at shard edges, and
    both state combines."""
    cfg, run, params = _setup(16, layer_stack="scan", remat="full")
    B, T = 2, 32
    tok = jax.random.randint(jax.random.key(3), (B, T + 1), 0, cfg.vocab_size)
    seg = np.zeros((B, T), np.int32)
    seg[0, 8:] = 1           # a boundary exactly at shard 1's first token (context 4: 8 tokens per shard)
    seg[0, 21:] = 2          # and one inside shard 2
    seg[1, 5:] = 1
    seg = jnp.asarray(seg)
    mesh = make_mesh({"data": 2, "context": 4})
    cp = ContextParallel(mesh, "fsdp", batch=B, combine=combine)
    loss = lambda p, d: lm_loss(p, tok[:, :-1], tok[:, 1:], cfg, run, dispatch=d, segment_ids=seg)  # noqa: E731
    ref, g1 = jax.jit(jax.value_and_grad(lambda p: loss(p, None)))(params)
    out, gc = jax.jit(jax.value_and_grad(lambda p: loss(p, cp)))(params)
    assert_close(out, ref, TOL["fp32_shallow"], name="loss")
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(gc), jax.tree.leaves(g1), strict=True):
        assert_close(a, b, TOL["fp32_mesh_vs_single"], atol_floor=1e-9, name=path_str(p))


@pytest.mark.parametrize("shape,B,layout", [({"context": 8}, 2, "loop"),
                                            pytest.param({"expert": 2, "context": 4}, 1, "scan",
                                                         marks=pytest.mark.slow)])  # CI's budget: loop stays
def test_prefill_then_greedy_decode_equals_one_device(shape, B, layout):
    """A context-parallel prefill (ragged rows: padding spanning whole shards) leaves the KDA state, conv tails and
    the latent cache (sharded over context) from which 16 greedy decode steps match one device."""
    cfg, run, params = _setup(16, layer_stack=layout)
    T = 64
    tok = np.asarray(jax.random.randint(jax.random.key(4), (B, T), 0, cfg.vocab_size))
    lengths = np.array([T, 19][:B])
    mesh, strategy, d = _placed(cfg, shape, B)

    def generate(dispatch):
        cache = C.init_cache(cfg, B, T + 32, run)
        p = params
        if dispatch is not None:
            cache = jax.device_put(cache, cache_shardings(strategy, mesh, cache,
                                                          replicated=small_batch(strategy, mesh, B)))
            p = jax.device_put(params, param_shardings(cfg, strategy, mesh))
        logits, cache = C.prefill(p, tok, lengths, cache, cfg, run, dispatch=dispatch, last_only=True)
        toks, steps = [], [logits]
        for _ in range(16):
            nxt = jnp.argmax(logits, -1)
            toks.append(np.asarray(nxt))
            logits, cache = C.decode_step(p, nxt, cache, cfg, run)
            steps.append(logits)
        return np.stack(toks, 1), jnp.stack(steps, 1), cache

    t1, l1, c1 = generate(None)
    t2, l2, c2 = generate(d)
    np.testing.assert_array_equal(t2, t1)
    assert_close(l2, l1, TOL["fp32_mesh_vs_single"], name="prefill + decode logits")
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(c2), jax.tree.leaves(c1), strict=True):
        assert_close(a, b, TOL["fp32_mesh_vs_single"], atol_floor=1e-6, name=f"cache {path_str(p)}")


def test_split_axes_and_bad_input():
    mesh = make_mesh({"fsdp": 2, "expert": 2, "context": 2})
    assert split_axes("fsdp_ep_tp", mesh, 4) == (("fsdp", "expert"), ("context",))
    assert split_axes("fsdp_ep_tp", mesh, 2) == (("fsdp",), ("expert", "context"))
    assert split_axes("fsdp_ep_tp", mesh, 1) == ((), ("fsdp", "expert", "context"))
    cp = ContextParallel(mesh, "fsdp_ep_tp", batch=1)
    assert cp.n == 8 and cp.row_axes == ("fsdp", "expert", "context")
    for T in (12, 20, 7):                           # not a multiple of 8 shards / fewer than 3 tokens per shard
        with pytest.raises(InputError, match="multiple of 8"):
            cp.check(T)
    cp.check(24)
    with pytest.raises(InputError, match="does not split sequences"):
        resolve_mesh("context=4", devices=8, strategy="single")
    cfg, run, params = _setup(16)
    with pytest.raises(InputError, match="sequence length 30"):
        forward(params, jnp.zeros((1, 30), jnp.int32), cfg, run, dispatch=ContextParallel(make_mesh({"context": 4}),
                                                                                            batch=1))


def _compiled(cfg, run, T, dispatch):
    """(loop-corrected FLOPs, collectives, temp bytes) per device of k3-mini's forward over [1, T] tokens."""
    from jax.sharding import NamedSharding, PartitionSpec

    from k3jax.model import abstract_params
    from k3jax.plan.hlo_cost import program_stats

    p = abstract_params(cfg, run)
    tok = jax.ShapeDtypeStruct((1, T), jnp.int32)
    if dispatch is not None:
        rep = NamedSharding(dispatch.mesh, PartitionSpec())
        p = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), p)
        tok = jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=dispatch.sharding(2))
    c = jax.jit(lambda p, t: forward(p, t, cfg, run, dispatch=dispatch)).lower(p, tok).compile()
    stats = program_stats(c.as_text())
    assert stats.unknown_trip_counts == 0
    return stats.flops, stats.collectives, c.memory_analysis().temp_size_in_bytes


def test_compiled_flops_and_temp_slope_split_eight_ways():
    """k3-mini's forward at context = 8: per-device compiled FLOPs within 1.25x of one eighth of the one-device
    program's (every loop's trip count known), and per-device temp bytes growing with T at <= 1.25x of one eighth
    of the one-device slope (T = 1024 -> 2048). The causal split is contiguous: attention's key loop runs over all
    T keys on every shard (masked blocks included, as on one device), so its FLOPs split exactly 8 ways; what does
    not split is each shard's up-projection of all T keys and values from the gathered latent, and KDA's K extra
    value columns (the state operator)."""
    cfg = get_preset("k3-mini")
    run = default_run(cfg)
    cp = ContextParallel(make_mesh({"context": 8}), batch=1)
    f1, t1 = {}, {}
    for T in (1024, 2048):
        one, _, temp_one = _compiled(cfg, run, T, None)
        eight, coll, temp_eight = _compiled(cfg, run, T, cp)
        f1[T], t1[T] = (one, eight), (temp_one, temp_eight)
        assert eight <= 1.25 * one / 8, (T, eight / (one / 8))
        assert "collective-permute" in coll            # the conv tails and the state scan
    slope_one = (t1[2048][0] - t1[1024][0]) / 1024
    slope_eight = (t1[2048][1] - t1[1024][1]) / 1024
    assert slope_eight <= 1.25 * slope_one / 8, slope_eight / (slope_one / 8)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from k3jax.checkpoint.save import save
    from k3jax.testing import random_params

    d = tmp_path_factory.mktemp("cp") / "tiny"
    save(random_params(get_preset("k3-tiny"), seed=5, std=0.2), get_preset("k3-tiny"), d)
    return str(d)


def test_cli_logits_and_route_on_a_context_mesh(tiny_ckpt, tmp_path, capsys):
    """`k3 logits --mesh context=4` writes the one-device logits (ragged rows; T = 30 is padded to 32 for the split
    and cut back); `k3 route --mesh context=4` (and data=2,context=4) counts the same loads as one device."""
    import json

    from k3jax.cli.main import main

    rng = np.random.default_rng(0)
    rows = rng.integers(0, 97, (2, 30)).astype(np.int32)
    rows[1, 21:] = -1
    np.save(tmp_path / "t.npy", rows)
    outs = {}
    for mesh in (None, "context=4", "data=2,context=4"):
        out = tmp_path / f"l{mesh}.npy"
        argv = ["logits", tiny_ckpt, "--tokens", str(tmp_path / "t.npy"), "--out", str(out)]
        assert main(argv + (["--mesh", mesh] if mesh else [])) == 0
        outs[mesh] = np.load(out)
    real = ~np.isnan(outs[None])
    for mesh in ("context=4", "data=2,context=4"):
        np.testing.assert_array_equal(np.isnan(outs[mesh]), ~real)
        assert_close(outs[mesh][real], outs[None][real], TOL["fp32_mesh_vs_single"], name=f"logits {mesh}")
    loads = {}
    for mesh in (None, "context=4", "data=2,context=4"):
        capsys.readouterr()
        argv = ["route", "--ckpt", tiny_ckpt, "--tokens", str(tmp_path / "t.npy"), "--batch", "2", "--json"]
        assert main(argv + (["--mesh", mesh] if mesh else [])) == 0
        loads[mesh] = [d["load"] for d in json.loads(capsys.readouterr().out)["layers"]]
    assert loads["context=4"] == loads[None] and loads["data=2,context=4"] == loads[None]


@pytest.mark.parametrize("argv,words", [
    (["route", "--seq-len", "30", "--mesh", "context=4"], "--seq-len 30"),
    (["route", "--mesh", "context=4,expert=2"], "this command splits over data, context only"),
    (["logits", "--mesh", "context=16"], "needs 16 devices"),
    (["train", "--preset", "k3-tiny", "--steps", "1", "--batch", "2", "--seq-len", "30", "--mesh", "data=2,context=4"],
     "--seq-len 30"),
    (["train", "--preset", "k3-tiny", "--steps", "1", "--mesh", "context=4", "--strategy", "single"],
     "does not split sequences"),
    (["plan", "--preset", "kimi-k3", "--compile", "--target", "cpu:8", "--mesh", "context=8", "--mode", "decode",
      "--batch", "8", "--context", "4096"], "decode step is one token"),
    (["plan", "--preset", "kimi-k3", "--compile", "--target", "cpu:8", "--mesh", "context=8", "--mode", "prefill",
      "--batch", "1", "--seq-len", "4100"], "--seq-len 4100"),
])
def test_bad_context_input_exits_2_naming_the_flag(tiny_ckpt, tmp_path, capsys, argv, words):
    from k3jax.cli.main import main

    np.save(tmp_path / "t.npy", np.arange(64, dtype=np.int32) % 97)
    if argv[0] == "route":
        argv = [*argv, "--ckpt", tiny_ckpt, "--tokens", str(tmp_path / "t.npy")]
    elif argv[0] == "logits":
        argv = [*argv, tiny_ckpt, "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "o.npy")]
    capsys.readouterr()
    assert main(argv) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "o.npy").exists()
