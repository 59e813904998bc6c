"""QK-Clip (SPEC §9.6): a forced large logit is clipped so the recomputed max logit equals τ; v columns, the shared
k^R (kv_a) and unclipped heads are untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.mla import mla_dims, mla_layer
from k3jax.model.params import init_mla
from k3jax.train.qk_clip import clip_factors, qk_clip


def _mla(q_lora: bool):
    return init_mla(jax.random.key(0), d=32, num_heads=3, q_lora_rank=16 if q_lora else None, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, output_gate=True)


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_b", "wq"])
def test_forced_large_logit_is_clipped_to_tau(q_lora):
    p = _mla(q_lora)
    qkey = "q_b" if q_lora else "wq"
    p[qkey] = p[qkey].at[:, 1, :].multiply(400.0)  # head 1 gets huge logits
    p["kv_b"] = p["kv_b"].at[:, 1, :8].multiply(20.0)
    x = jax.random.normal(jax.random.key(1), (2, 12, 32), jnp.float32)
    _, ml = mla_layer(p, x, norm_eps=1e-6, block_size=4)
    s = np.asarray(jnp.max(ml, axis=0))
    tau = 5.0
    assert s[1] > 10 * tau and s[0] < tau and s[2] < tau, s
    params = {"layers": [{"kda": {}}, {"mla": p}]}
    new, info = qk_clip(params, [ml], tau=tau)
    q = new["layers"][1]["mla"]
    _, ml2 = mla_layer(q, x, norm_eps=1e-6, block_size=4)
    s2 = np.asarray(jnp.max(ml2, axis=0))
    np.testing.assert_allclose(s2[1], tau, rtol=1e-5)
    np.testing.assert_array_equal(s2[[0, 2]], s[[0, 2]])  # other heads: bit-identical
    assert info["clipped"].tolist() == [[False, True, False]]
    N, Hn, Hr, V = mla_dims(p)
    np.testing.assert_array_equal(q["kv_b"][:, :, Hn:], p["kv_b"][:, :, Hn:])  # v columns untouched
    np.testing.assert_array_equal(q["kv_a"], p["kv_a"])  # shared k^R untouched
    for k in p:
        if k not in (qkey, "kv_b"):
            np.testing.assert_array_equal(q[k], p[k])
    g = float(info["gamma"][0, 1])
    np.testing.assert_allclose(q[qkey][:, 1, :Hn], p[qkey][:, 1, :Hn] * np.sqrt(g), rtol=1e-6)
    np.testing.assert_allclose(q[qkey][:, 1, Hn:], p[qkey][:, 1, Hn:] * g, rtol=1e-6)
    np.testing.assert_allclose(q["kv_b"][:, 1, :Hn], p["kv_b"][:, 1, :Hn] * np.sqrt(g), rtol=1e-6)
    np.testing.assert_array_equal(q[qkey][:, [0, 2]], p[qkey][:, [0, 2]])


def test_no_clip_below_tau_and_switch_off_by_threshold():
    gamma, clipped = clip_factors(jnp.array([1.0, 100.0, 250.0]), 100.0)
    assert clipped.tolist() == [False, False, True]
    np.testing.assert_allclose(gamma, [1.0, 1.0, 0.4])


def test_layer_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="MLA layers"):
        qk_clip({"layers": [{"mla": _mla(True)}]}, [], tau=1.0)
