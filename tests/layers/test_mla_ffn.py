"""Gated MLA and the GLU FFN against the float64 NumPy transcription (SPEC §5.1, §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.ffn import glu_ffn
from k3jax.layers.mla import mla_dims, mla_layer
from k3jax.model.params import init_glu, init_mla
from k3jax.reference import model as ref
from k3jax.testing import assert_close


def _mla_params(q_lora, gate, dtype, scale=6.0):
    p = init_mla(jax.random.key(0), d=32, num_heads=3, q_lora_rank=q_lora, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=6, output_gate=gate, dtype=dtype)
    return jax.tree.map(lambda a: a * scale if a.ndim >= 2 else a, p)


@pytest.mark.parametrize("q_lora,gate", [(12, True), (None, False), (12, False)])
def test_mla_matches_reference(q_lora, gate, x64):
    p = _mla_params(q_lora, gate, jnp.float64)
    assert mla_dims(p) == (3, 8, 4, 6)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 11, 32)))
    want = np.stack([ref.mla(ref.f64(p), np.asarray(x[b]), 1e-6) for b in range(2)])
    for block in (4, 11, 64):
        y, ml = mla_layer(p, x, norm_eps=1e-6, block_size=block)
        assert_close(y, want, 1e-12, name=f"fp64 block {block}")
    p32 = jax.tree.map(lambda a: a.astype(jnp.float32), p)
    y32, _ = mla_layer(p32, x.astype(jnp.float32), norm_eps=1e-6, block_size=4)
    assert_close(y32, want, 1e-5, name="fp32")
    assert ml.shape == (2, 3)


def test_mla_scale_uses_full_qk_dim_and_shared_rope_slice(x64):
    # Zeroing the rope-sized q slice must change the output (the unrotated shared k^R takes part in the score).
    p = _mla_params(12, True, jnp.float64)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 7, 32)))
    y1, _ = mla_layer(p, x, norm_eps=1e-6)
    p2 = dict(p, q_b=p["q_b"].at[:, :, 8:].set(0.0))
    y2, _ = mla_layer(p2, x, norm_eps=1e-6)
    assert not np.allclose(np.asarray(y1), np.asarray(y2))


def test_mla_gradients_match_fp64_autodiff_of_dense_softmax(x64):
    p = _mla_params(12, True, jnp.float64, scale=3.0)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 9, 32)))
    ct = jnp.asarray(np.random.default_rng(3).normal(size=(1, 9, 32)))
    g_block = jax.grad(lambda p, x: jnp.sum(mla_layer(p, x, norm_eps=1e-6, block_size=4)[0] * ct), (0, 1))(p, x)
    g_one = jax.grad(lambda p, x: jnp.sum(mla_layer(p, x, norm_eps=1e-6, block_size=64)[0] * ct), (0, 1))(p, x)
    for a, b in zip(jax.tree.leaves(g_block), jax.tree.leaves(g_one)):
        assert_close(a, b, 1e-12)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_glu_ffn_matches_reference(act, x64):
    p = jax.tree.map(lambda a: a * 20, init_glu(jax.random.key(1), d=16, hidden=40, dtype=jnp.float64))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 16)) * 4)
    want = ref.glu(ref.f64(p), np.asarray(x), act, 4.0, 25.0)
    assert_close(glu_ffn(p, x, act=act), want, 1e-12)
    p32 = jax.tree.map(lambda a: a.astype(jnp.float32), p)
    assert_close(glu_ffn(p32, x.astype(jnp.float32), act=act), want, 1e-5)


def test_fused_shared_experts_equal_sum_of_two():
    # SPEC §6: two F-wide SiTU-GLU experts == one 2F-wide expert with concatenated gate/up columns and down rows.
    a = init_glu(jax.random.key(2), d=16, hidden=8)
    b = init_glu(jax.random.key(3), d=16, hidden=8)
    fused = {"w_gate": jnp.concatenate([a["w_gate"], b["w_gate"]], 1),
             "w_up": jnp.concatenate([a["w_up"], b["w_up"]], 1),
             "w_down": jnp.concatenate([a["w_down"], b["w_down"]], 0)}
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 16)), jnp.float32)
    assert_close(glu_ffn(fused, x, act="situ"), glu_ffn(a, x, act="situ") + glu_ffn(b, x, act="situ"), 1e-6)
