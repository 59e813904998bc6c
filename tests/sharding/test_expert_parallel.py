"""Expert-parallel dispatch (shard_map + bucketed all_to_all on CPU) vs the single-device dense reference."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.config import get_preset
from k3jax.model import forward, init_params, lm_loss
from k3jax.ops.activations import glu_activation
from k3jax.ops.grouped_matmul import experts_dense
from k3jax.pytree import key_names, path_str
from k3jax.sharding.expert_parallel import ExpertParallel, bucket_capacity
from k3jax.sharding.mesh import make_mesh
from k3jax.sharding.rules import param_shardings
from k3jax.testing import TOL, assert_close, emulated_ragged_all_to_all

ACT = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
M, A, E, Pd, F = 64, 2, 8, 16, 12


def _problem(routing: str, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 6)
    z = jax.random.normal(k[0], (M, Pd))
    w1 = 0.3 * jax.random.normal(k[1], (E, Pd, F))
    w3 = 0.3 * jax.random.normal(k[2], (E, Pd, F))
    w2 = 0.3 * jax.random.normal(k[3], (E, F, Pd))
    s = jax.random.normal(k[4], (M, E))
    if routing == "balanced":  # token i → experts i, i+1 (mod E): every expert gets exactly M·A/E rows
        ids = (jnp.arange(M)[:, None] + jnp.arange(A)[None, :]) % E
    elif routing == "skewed":  # every token picks expert 5 (lives on shard 2) plus one random other expert
        other = jax.lax.top_k(s.at[:, 5].set(-jnp.inf), 1)[1][:, 0]
        ids = jnp.stack([jnp.full((M,), 5), other], axis=1)
    elif routing == "empty":  # experts 0..3 (all of shards 0 and 1) receive nothing
        ids = jax.lax.top_k(s[:, 4:], A)[1] + 4
    else:
        raise ValueError(routing)
    wts = jax.nn.softmax(jax.random.normal(k[5], (M, A)))
    return z, ids.astype(jnp.int32), wts, w1, w3, w2


def _check(ep, routing):
    z, ids, wts, w1, w3, w2 = _problem(routing)
    y, dropped = jax.jit(lambda *a: ep.dispatch(*a, ACT))(z, ids, wts, w1, w3, w2)
    assert int(dropped) == 0
    assert_close(y, experts_dense(z, ids, wts, w1, w3, w2, ACT), TOL["fp32_shallow"], name=f"{routing} fwd")

    def loss(fn, z, wts, w1, w3, w2):
        return jnp.sum(jnp.sin(fn(z, ids, wts, w1, w3, w2, ACT)))

    g = jax.jit(jax.grad(partial(loss, ep), argnums=(0, 1, 2, 3, 4)))(z, wts, w1, w3, w2)
    gr = jax.grad(partial(loss, experts_dense), argnums=(0, 1, 2, 3, 4))(z, wts, w1, w3, w2)
    for name, a, b in zip(("dz", "dweights", "dw1", "dw3", "dw2"), g, gr, strict=True):
        assert_close(a, b, TOL["fp32_vs_fp64"], name=f"{routing} {name}")


@pytest.mark.parametrize("routing", ["balanced", "skewed", "empty"])
def test_ep_matches_dense_reference(routing):
    # impl="auto": lax.platform_dependent picks the bucketed all_to_all path on CPU
    _check(ExpertParallel(make_mesh({"data": 2, "expert": 4}), "ep"), routing)


def test_ep_with_tensor_sharded_expert_hidden():
    _check(ExpertParallel(make_mesh({"expert": 4, "tensor": 2}), "ep_tp"), "skewed")


def test_bucket_capacity():
    assert bucket_capacity(8, 2, 2, 4, -1) == 16  # worst case m·min(A, El)
    assert bucket_capacity(8, 4, 2, 4, -1) == 16  # a token sends at most El rows to one shard
    assert bucket_capacity(8, 2, 2, 4, 1.0) == 4  # ceil(cf·m·A/X)
    assert bucket_capacity(8, 2, 2, 4, 100.0) == 16  # never above the worst case
    with pytest.raises(ValueError):
        bucket_capacity(8, 2, 2, 4, 0.0)


def test_capacity_overflow_is_counted_not_silent():
    mesh = make_mesh({"data": 2, "expert": 4})
    z, ids, wts, w1, w3, w2 = _problem("skewed")
    ep = ExpertParallel(mesh, "ep", capacity_factor=1.0)
    # expected drops: per token shard (8 tokens), rows per destination shard beyond C = ceil(8·2/4) = 4
    C = bucket_capacity(M // 8, A, E // 4, 4, 1.0)
    dest = np.asarray(ids).reshape(8, -1) // (E // 4)
    want = sum(max(0, int(np.sum(d == x)) - C) for d in dest for x in range(4))
    assert want > 0
    y, dropped = jax.jit(lambda *a: ep.dispatch(*a, ACT))(z, ids, wts, w1, w3, w2)
    assert int(dropped) == want
    jax.block_until_ready(jax.jit(lambda *a: ep(*a, ACT))(z, ids, wts, w1, w3, w2))
    assert ep.dropped == [want]
    with pytest.raises(RuntimeError, match=f"dropped {want} assignments"):
        ep.check()
    # worst-case buffers on the same skewed routing: nothing dropped, nothing recorded
    ep0 = ExpertParallel(mesh, "ep")
    _, d0 = ep0.dispatch(z, ids, wts, w1, w3, w2, ACT)
    assert int(d0) == 0 and ep0.dropped == []
    ep0.check()


def test_ep_bad_mesh_is_an_error():
    ep = ExpertParallel(make_mesh({"data": 2, "expert": 4}), "ep")
    z, ids, wts, w1, w3, w2 = _problem("balanced")
    with pytest.raises(ValueError, match="num_experts=6 .*'expert' \\(size 4\\)"):
        ep.dispatch(z, ids % 6, wts, w1[:6], w3[:6], w2[:6], ACT)


@pytest.mark.slow  # CI's budget, session 9: 3 layers in the slow pass, 5 manual
@pytest.mark.parametrize("num_layers", [3, pytest.param(5, marks=pytest.mark.manual)])
def test_model_forward_and_grad_through_ep(num_layers):
    """k3-tiny (KDA + MLA + LatentMoE + AttnRes): logits and every parameter gradient through the EP dispatch equal
    the default sorted single-device path. One jitted value_and_grad per path (compile time dominates, so the
    default run truncates k3-tiny to 3 layers — dense KDA, KDA + MoE, MLA + MoE; the full 5 layers is slow)."""
    cfg = get_preset("k3-tiny")
    if num_layers != cfg.num_layers:
        cfg = get_preset("k3-tiny", num_layers=num_layers, full_attn_layers=(num_layers,))
    mesh = make_mesh({"data": 2, "expert": 4})
    params = init_params(cfg, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    ep = ExpertParallel(mesh, "ep")
    sharded = jax.device_put(params, param_shardings(cfg, "ep", mesh))

    def loss(p, dispatch):
        logits = forward(p, tokens, cfg, dispatch=dispatch)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.mean(ce), logits

    (ref_l, ref_logits), ref_g = jax.jit(jax.value_and_grad(partial(loss, dispatch="sorted"), has_aux=True))(params)
    (l, logits), g = jax.jit(jax.value_and_grad(partial(loss, dispatch=ep), has_aux=True))(sharded)
    assert_close(logits, ref_logits, TOL["fp32_vs_fp64"], name="logits")
    assert_close(l, ref_l, TOL["fp32_shallow"], name="loss")
    assert_close(l, lm_loss(params, tokens, targets, cfg), TOL["fp32_shallow"], name="loss vs lm_loss")
    flat_ref = jax.tree_util.tree_flatten_with_path(ref_g)[0]
    moe_grads = 0
    for (path, r), x in zip(flat_ref, jax.tree.leaves(g), strict=True):
        if float(jnp.max(jnp.abs(r))) == 0.0:  # the QB bias: selection only, no gradient
            assert float(jnp.max(jnp.abs(x))) == 0.0
            continue
        moe_grads += "experts" in key_names(path)
        assert_close(x, r, TOL["fp32_vs_fp64"], name=path_str(path))
    assert moe_grads == 3 * (num_layers - 1)  # w1, w3, w2 of every MoE layer were checked


def test_ragged_path_bookkeeping_with_emulated_collective(monkeypatch):
    """The GPU/TPU path (impl="ragged") cannot run on XLA:CPU; with the collective emulated from its documented
    semantics, its offsets (send/recv sizes, output and return offsets, un-sort) give the dense result and grads."""
    import k3jax.sharding.expert_parallel as ep_mod

    monkeypatch.setattr(ep_mod, "_ragged_all_to_all", emulated_ragged_all_to_all)
    _check(ExpertParallel(make_mesh({"data": 2, "expert": 4}), "ep", impl="ragged"), "skewed")


def test_ragged_path_capacity_drops_the_rows_the_bucketed_path_drops(monkeypatch):
    """Under a capacity (cf = 1: C = ceil(m·A/X) rows per (source, destination)), the ragged path sends the same
    first-C rows in sorted order as the bucketed path keeps: same outputs, same dropped count, and its receive
    buffer is X·C rows instead of the worst case's X·m·min(A, El)."""
    import k3jax.sharding.expert_parallel as ep_mod

    monkeypatch.setattr(ep_mod, "_ragged_all_to_all", emulated_ragged_all_to_all)
    mesh = make_mesh({"data": 2, "expert": 4})
    z, ids, wts, w1, w3, w2 = _problem("skewed")
    run = lambda impl: jax.jit(lambda *a: ExpertParallel(mesh, "ep", capacity_factor=1.0, impl=impl)  # noqa: E731
                               .dispatch(*a, ACT))(z, ids, wts, w1, w3, w2)
    (yb, db), (yr, dr) = run("bucketed"), run("ragged")
    assert int(db) == int(dr) > 0
    assert_close(yr, yb, TOL["fp32_shallow"], name="ragged vs bucketed under a capacity")
    text = jax.jit(lambda *a: ExpertParallel(mesh, "ep", capacity_factor=1.0, impl="ragged")
                   .dispatch(*a, ACT)).lower(z, ids, wts, w1, w3, w2).as_text()
    C = bucket_capacity(M // 8, A, E // 4, 4, 1.0)
    assert f"tensor<{4 * C}x{Pd}xf32>" in text  # the receive buffer: X·C rows of P


def test_expert_stacks_split_over_fsdp_gather_inside_and_gradients_reduce_scatter():
    """Under ``fsdp_ep_tp`` a float expert stack's width P is split over fsdp as stored: it enters the shard_map so
    and is all-gathered inside, so its gradient leaves by a reduce-scatter (the gather's transpose) in the
    parameter's sharding — not a psum of the whole stack. Values and gradients equal the dense reference."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh({"fsdp": 2, "expert": 4})
    ep = ExpertParallel(mesh, "fsdp_ep_tp")
    assert ep.width_axes == ("fsdp",)
    _check(ep, "skewed")
    z, ids, wts, w1, w3, w2 = _problem("balanced")
    put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))  # noqa: E731
    args = (put(z, ("fsdp", "expert")), put(wts, ("fsdp", "expert")), put(w1, "expert", "fsdp"),
            put(w3, "expert", "fsdp"), put(w2, "expert", None, "fsdp"))

    def loss(z, wts, w1, w3, w2):
        return jnp.sum(jnp.sin(ep(z, ids, wts, w1, w3, w2, ACT)))

    grad = jax.jit(jax.grad(loss, argnums=(2, 3, 4)))
    text = grad.lower(*args).compile().as_text()
    assert "reduce-scatter" in text
    stack = f"f32[{E // 4},{Pd},{F}]"  # a device's experts, width gathered: what a psum of the stack would reduce
    assert not [ln for ln in text.splitlines() if "all-reduce(" in ln and stack in ln.split("all-reduce(")[0]]
    for g, spec in zip(grad(*args), (P("expert", "fsdp"), P("expert", "fsdp"), P("expert", None, "fsdp"))):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim)
