"""Routing (docs/model.md §7.1, docs/numerics.md §15.3 item 6) and the two expert dispatches (dense vs sort-based) —
forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3jax.layers.moe import MoE
from k3jax.ops.activations import glu_activation
from k3jax.ops.grouped_matmul import EXPERT_IMPLS, default_tile, experts_dense
from k3jax.ops.routing import route
from k3jax.reference import model as ref
from k3jax.testing import TOL, assert_close, block


def _router(seed, M=24, D=16, E=8):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(M, D)), jnp.float32), jnp.asarray(rng.normal(size=(D, E)), jnp.float32),
            jnp.asarray(rng.normal(size=E) * 0.3, jnp.float32))


def test_routing_rules():
    x, w, b = _router(0)
    r = route(x, w, b, top_k=3, renormalize=True, scaling_factor=2.5)
    s = jax.nn.sigmoid(x @ w)
    biased = np.asarray(s + b)
    for m in range(x.shape[0]):
        order = np.argsort(-biased[m], kind="stable")
        assert list(np.asarray(r.ids[m])) == list(order[:3])  # top-k of s + b
        assert_close(r.cutoff[m], biased[m, order[3]], TOL["fp32_shallow"])  # (k+1)-th biased value
        sel = np.asarray(s)[m, order[:3]]
        assert_close(r.weights[m], 2.5 * sel / sel.sum(), TOL["fp32_shallow"])  # unbiased s
    assert_close(r.weights.sum(-1), np.full(x.shape[0], 2.5), TOL["fp32_shallow"])


def test_bias_never_changes_selected_weights():
    x, w, b = _router(1)
    r1 = route(x, w, b, top_k=3)
    r2 = route(x, w, b + 10.0, top_k=3)  # a constant shift selects the same experts
    np.testing.assert_array_equal(np.asarray(r1.ids), np.asarray(r2.ids))
    np.testing.assert_array_equal(np.asarray(r1.weights), np.asarray(r2.weights))
    # the bias carries no gradient
    gb = jax.grad(lambda b: jnp.sum(route(x, w, b, top_k=3).weights ** 2))(b)
    np.testing.assert_array_equal(np.asarray(gb), 0.0)


def test_top_k_equals_num_experts_has_no_cutoff():
    x, w, b = _router(2, E=4)
    r = route(x, w, b, top_k=4)
    assert np.all(np.isneginf(np.asarray(r.cutoff)))


def _experts(seed, E=6, P=16, F=12):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((E, P, F), (E, P, F), (E, F, P)))


ACT = lambda a, b: glu_activation(a, b, act="situ")  # noqa: E731


@settings(max_examples=3)  # each example recompiles forward + backward of both paths (+ the 3 explicit ones)
@given(st.integers(1, 40), st.integers(1, 6), st.sampled_from(["balanced", "one_expert", "empty_experts"]),
       st.integers(0, 10**6))
@example(1, 1, "one_expert", 0)
@example(37, 6, "balanced", 1)  # top_k == num_experts
@example(23, 3, "empty_experts", 2)
def test_dense_and_sorted_dispatch_agree(M, A, pattern, seed):
    E = 6
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.normal(size=(M, 16)), jnp.float32)
    if pattern == "balanced":
        ids = np.stack([rng.permutation(E)[:A] for _ in range(M)])
    elif pattern == "one_expert":
        ids = np.stack([(np.arange(A) + 2) % E for _ in range(M)])  # every token hits expert 2 first
    else:
        ids = np.stack([rng.permutation(3)[: min(A, 3)] for _ in range(M)])  # experts 3..5 get nothing
    ids = jnp.asarray(ids, jnp.int32)
    wts = jnp.asarray(rng.uniform(size=ids.shape), jnp.float32)
    w1, w3, w2 = _experts(seed % 97)

    def fwd_grad(fn):  # one jit per path: far fewer compiles than op-by-op grads at every new example shape
        def loss(z, w1, w3, w2, wts):
            return jnp.sum(jnp.sin(fn(z, ids, wts, w1, w3, w2, ACT)))

        return jax.jit(lambda *a: (fn(a[0], ids, a[4], *a[1:4], ACT), jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*a)))

    want, gb = fwd_grad(experts_dense)(z, w1, w3, w2, wts)
    for impl in ("ragged", "tiled", "sorted"):
        got, ga = fwd_grad(EXPERT_IMPLS[impl])(z, w1, w3, w2, wts)
        assert_close(got, want, TOL["fp32_shallow"], name=impl)
        for x, y, n in zip(ga, gb, ["z", "w1", "w3", "w2", "weights"]):
            assert_close(x, y, TOL["fp32_vs_fp64"], name=f"{impl} d{n}")


def test_default_tile():
    assert default_tile(32768, 16) == 128 and default_tile(32768, 256) == 32 and default_tile(8, 256) == 8


@pytest.mark.parametrize("latent", [16, None])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_layer_matches_reference(latent, act, x64):
    D = 24
    p, moe_layer = block(MoE, jax.random.key(0), d=D, num_experts=8, expert_hidden=12,
                         num_shared=2 if latent else 1, latent=latent, latent_norm=latent is not None,
                         dtype=jnp.float64)
    p = jax.tree.map(lambda a: a * 10 if a.ndim >= 2 else a, p)  # larger weights: non-trivial routing
    p["bias"] = jnp.asarray(np.random.default_rng(1).normal(size=8) * 0.05)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 9, D)))
    kw = dict(top_k=3, act=act, renormalize=True, scaling_factor=2.5, norm_eps=1e-5)
    want = np.stack([ref.moe(ref.f64(p), np.asarray(x[b]), top_k=3, act=act, beta1=4.0, beta2=25.0,
                             renormalize=True, rsf=2.5, eps=1e-5) for b in range(2)])
    for dispatch in ("sorted", "ragged", "tiled", "dense"):
        y, routing = moe_layer(p, x, dispatch=dispatch, **kw)
        assert y.dtype == jnp.float64
        assert_close(y, want, TOL["fp64_vs_fp64"], name=f"{dispatch} fp64")
        assert routing.ids.shape == (2, 9, 3) and routing.scores.shape == (2, 9, 8)
        p32 = jax.tree.map(lambda a: a.astype(jnp.float32), p)
        y32, _ = moe_layer(p32, x.astype(jnp.float32), dispatch=dispatch, **kw)
        assert_close(y32, want, TOL["fp32_vs_fp64"], name=f"{dispatch} fp32")


def test_moe_permuting_experts_changes_nothing():
    D = 16
    p, moe_layer = block(MoE, jax.random.key(3), d=D, num_experts=8, expert_hidden=8, num_shared=2, latent=8,
                         latent_norm=True)
    p = jax.tree.map(lambda a: a * 10 if a.ndim >= 2 else a, p)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 11, D)), jnp.float32)
    perm = np.random.default_rng(1).permutation(8)
    q = dict(p, router=p["router"][:, perm], bias=p["bias"][perm],
             experts={k: v[perm] for k, v in p["experts"].items()})
    y1, _ = moe_layer(p, x, top_k=2, act="situ")
    y2, _ = moe_layer(q, x, top_k=2, act="situ")
    assert_close(y2, y1, TOL["fp32_shallow"])


def test_all_experts_uniform_router_is_dense_mixture():
    # top_k == E with a zero router: every weight 1/E — the plain average of all experts.
    D, E = 12, 4
    p, moe_layer = block(MoE, jax.random.key(4), d=D, num_experts=E, expert_hidden=6, num_shared=0, latent=None,
                         latent_norm=False)
    p["router"] = jnp.zeros_like(p["router"])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, D)), jnp.float32)
    y, _ = moe_layer(p, x, top_k=E, act="silu")
    ex = p["experts"]
    want = np.mean([ref.glu({"w_gate": np.asarray(ex["w1"][e], np.float64), "w_up": np.asarray(ex["w3"][e]),
                             "w_down": np.asarray(ex["w2"][e])}, np.asarray(x[0], np.float64), "silu", 4, 25)
                    for e in range(E)], axis=0)
    assert_close(y[0], want, TOL["fp32_vs_fp64"])
