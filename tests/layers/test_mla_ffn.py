"""Gated MLA and the GLU FFN against the float64 NumPy transcription (docs/model.md §5.1, §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers.ffn import GLU
from k3jax.layers.mla import MLA
from k3jax.reference import model as ref
from k3jax.testing import assert_close


def params(blk) -> dict:
    """The block's parameter dict (what the float64 oracle takes)."""
    return nnx.state(blk, nnx.Param).to_pure_dict()


def with_params(blk, p: dict):
    """A block of ``blk``'s structure holding the parameter dict ``p``."""
    return nnx.merge(nnx.graphdef(blk), p)


def _mla(q_lora, gate, dtype, scale=6.0):
    blk = MLA(d=32, num_heads=3, q_lora_rank=q_lora, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=6, output_gate=gate, dtype=dtype, rngs=nnx.Rngs(0))
    return with_params(blk, jax.tree.map(lambda a: a * scale if a.ndim >= 2 else a, params(blk)))


@pytest.mark.parametrize("q_lora,gate", [(12, True), (None, False), (12, False)])
def test_mla_matches_reference(q_lora, gate, x64):
    blk = _mla(q_lora, gate, jnp.float64)
    assert blk.dims == (3, 8, 4, 6)
    p = params(blk)
    assert all(a.dtype == jnp.float64 for a in jax.tree.leaves(p))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 11, 32)))
    want = np.stack([ref.mla(ref.f64(p), np.asarray(x[b]), 1e-6) for b in range(2)])
    for block in (4, 11, 64):
        y, ml = blk(x, norm_eps=1e-6, block_size=block)
        assert_close(y, want, 1e-12, name=f"fp64 block {block}")
    b32 = with_params(blk, jax.tree.map(lambda a: a.astype(jnp.float32), p))
    y32, _ = b32(x.astype(jnp.float32), norm_eps=1e-6, block_size=4)
    assert_close(y32, want, 1e-5, name="fp32")
    assert ml.shape == (2, 3)


def test_mla_scale_uses_full_qk_dim_and_shared_rope_slice(x64):
    # Zeroing the rope-sized q slice must change the output (the unrotated shared k^R takes part in the score).
    blk = _mla(12, True, jnp.float64)
    p = params(blk)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 7, 32)))
    y1, _ = blk(x, norm_eps=1e-6)
    y2, _ = with_params(blk, dict(p, q_b=p["q_b"].at[:, :, 8:].set(0.0)))(x, norm_eps=1e-6)
    assert not np.allclose(np.asarray(y1), np.asarray(y2))


def test_mla_gradients_match_fp64_autodiff_of_dense_softmax(x64):
    blk = _mla(12, True, jnp.float64, scale=3.0)
    gd, p = nnx.graphdef(blk), params(blk)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 9, 32)))
    ct = jnp.asarray(np.random.default_rng(3).normal(size=(1, 9, 32)))

    def loss(block_size):
        return lambda p, x: jnp.sum(nnx.merge(gd, p)(x, norm_eps=1e-6, block_size=block_size)[0] * ct)

    g_block = jax.grad(loss(4), (0, 1))(p, x)
    g_one = jax.grad(loss(64), (0, 1))(p, x)
    assert jax.tree.structure(g_block) == jax.tree.structure(g_one)
    for a, b in zip(jax.tree.leaves(g_block), jax.tree.leaves(g_one)):
        assert_close(a, b, 1e-12)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_glu_ffn_matches_reference(act, x64):
    blk = GLU(d=16, hidden=40, dtype=jnp.float64, rngs=nnx.Rngs(1))
    p = jax.tree.map(lambda a: a * 20, params(blk))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 16)) * 4)
    want = ref.glu(ref.f64(p), np.asarray(x), act, 4.0, 25.0)
    assert_close(with_params(blk, p)(x, act=act), want, 1e-12)
    p32 = jax.tree.map(lambda a: a.astype(jnp.float32), p)
    assert_close(with_params(blk, p32)(x.astype(jnp.float32), act=act), want, 1e-5)


def test_fused_shared_experts_equal_sum_of_two():
    # docs/model.md §6: two F-wide SiTU-GLU experts == one 2F-wide expert with concatenated gate/up columns and down
    # rows.
    a = GLU(d=16, hidden=8, rngs=nnx.Rngs(2))
    b = GLU(d=16, hidden=8, rngs=nnx.Rngs(3))
    pa, pb = params(a), params(b)
    fused = GLU(d=16, hidden=16, rngs=nnx.Rngs(4))
    nnx.update(fused, {"w_gate": jnp.concatenate([pa["w_gate"], pb["w_gate"]], 1),
                       "w_up": jnp.concatenate([pa["w_up"], pb["w_up"]], 1),
                       "w_down": jnp.concatenate([pa["w_down"], pb["w_down"]], 0)})
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 16)), jnp.float32)
    assert_close(fused(x, act="situ"), a(x, act="situ") + b(x, act="situ"), 1e-6)
