"""LoRA dropout in the blocks (k3jax/layers/lora.py ``dropout_scope``): inside a scope the adapted projections of a
GLU and of a MoE block (shared GLU and routed experts, per-expert and shared A) drop their adapters' inputs — the
output moves, is fixed by the key, and the gradients reach A and B —; the base path never sees the dropout (B = 0:
bit for bit the undropped block), no scope is the undropped block, each projection draws its own mask, and a weight
consumed merged refuses a scope."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.errors import InputError
from k3jax.layers.ffn import GLU
from k3jax.layers.lora import add_adapters, dropout_scope, merged, projection_id
from k3jax.layers.moe import MoE
from k3jax.ops.lora import LoraDropout

D, E, F, R, TOP_K = 32, 8, 48, 4, 2
RATE = 0.25


def _glu():
    glu = GLU(d=D, hidden=F, rngs=nnx.Rngs(0))
    add_adapters(glu, rank=R, scale=2.0, rngs=nnx.Rngs(1))
    return glu


def _moe(shared_a: bool):
    moe = MoE(d=D, num_experts=E, expert_hidden=F, num_shared=1, latent=None, latent_norm=False, rngs=nnx.Rngs(0))
    add_adapters(moe.shared, rank=R, scale=2.0, rngs=nnx.Rngs(1))
    add_adapters(moe.experts, rank=R, scale=2.0, rngs=nnx.Rngs(2), shared_a=shared_a)
    return moe


def _nonzero_b(module, seed=3):
    """Every adapter's B random (a trained adapter: the low-rank path counts)."""
    graph, state = nnx.split(module)
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)
        if jax.tree_util.keystr(p).endswith("_lora_b']") else x, state.to_pure_dict())
    return graph, params


def _call(graph, kind):
    if kind == "glu":
        return lambda params, x: nnx.merge(graph, params)(x, act="situ")
    return lambda params, x: nnx.merge(graph, params)(x, top_k=TOP_K, act="situ")[0]


def _loss_and_grads(graph, kind, params, x, key):
    """jit(value_and_grad) of mean(y²) over the block's parameters, inside a scope of ``key``."""
    f = _call(graph, kind)

    def loss(params, key):
        with dropout_scope(LoraDropout(key, RATE)):
            return jnp.mean(f(params, x) ** 2)

    return jax.jit(jax.value_and_grad(loss))(params, key)


# the MoE block holds a shared GLU and the routed experts: both adapter paths. The others run in the slow pass
# (~3 s and ~14 s; their products are checked on their own in tests/ops/test_lora_dropout.py)
@pytest.mark.parametrize("kind", [pytest.param("glu", marks=pytest.mark.slow), "moe-per-expert-A",
                                  pytest.param("moe-shared-A", marks=pytest.mark.slow)])
def test_dropout_moves_the_output_deterministically_and_reaches_a_and_b(kind):
    module = _glu() if kind == "glu" else _moe(kind == "moe-shared-A")
    graph, params = _nonzero_b(module)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 8, D)), jnp.float32)
    one, g_one = _loss_and_grads(graph, kind, params, x, jax.random.key(1))
    again, g_again = _loss_and_grads(graph, kind, params, x, jax.random.key(1))
    other, _ = _loss_and_grads(graph, kind, params, x, jax.random.key(2))
    plain = float(jnp.mean(jax.jit(_call(graph, kind))(params, x) ** 2))   # no scope: the undropped block
    assert float(one) == float(again) and float(one) != plain and float(other) != float(one)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g_one), jax.tree.leaves(g_again), strict=True))
    grads = [(jax.tree_util.keystr(p), np.asarray(g)) for p, g in jax.tree_util.tree_leaves_with_path(g_one)
             if "_lora_" in jax.tree_util.keystr(p)]
    assert {n.split("'")[-2].rsplit("_", 1)[-1] for n, _ in grads} == {"a", "b"}
    for name, g in grads:                                          # finite and nonzero on every A and B
        assert np.all(np.isfinite(g)) and np.any(g != 0), name


def test_the_base_path_sees_x_undropped():
    """B = 0 (a fresh adapter): the adapter adds exactly 0 whatever its input, so a scope changes nothing, bit for
    bit — the base products (here a MoE's shared GLU and routed experts) read x whole."""
    graph, params = nnx.split(_moe(False))
    params = params.to_pure_dict()
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 8, D)), jnp.float32)
    f = _call(graph, "moe")

    def dropped(params, x, key):
        with dropout_scope(LoraDropout(key, RATE)):
            return f(params, x)

    np.testing.assert_array_equal(jax.jit(dropped)(params, x, jax.random.key(6)), jax.jit(f)(params, x))


def test_each_projection_draws_its_own_mask():
    """A layer's key is folded with the projection's id (block class and leaf), stable across instances: the
    projections of one layer that read the same x (w_gate and w_up, w1 and w3) drop it with different masks."""
    glu, moe = _glu(), _moe(False)
    ids = [projection_id(b, n) for b, names in ((glu, GLU.LORA), (moe.experts, ("w1", "w3", "w2"))) for n in names]
    assert len(set(ids)) == 6 and projection_id(glu, "w_gate") == projection_id(moe.shared, "w_gate")
    drop = LoraDropout(jax.random.key(7), RATE)
    for a, b in (("w_gate", "w_up"), ("w1", "w3")):
        block = glu if a == "w_gate" else moe.experts
        assert not np.array_equal(drop.fold(projection_id(block, a)).keep_mask((4, D)),
                                  drop.fold(projection_id(block, b)).keep_mask((4, D)))


def test_a_merged_weight_refuses_a_dropout_scope():
    glu = _glu()
    w = merged(glu, "w_gate")                                       # no scope: W + s A B
    assert w.shape == glu.w_gate.shape
    with dropout_scope(LoraDropout(jax.random.key(0), RATE)), pytest.raises(InputError, match="GLU.w_gate"):
        merged(glu, "w_gate")
