"""QK-Clip (docs/model.md §9.6): a forced large logit is clipped so the recomputed max logit equals τ; v columns, the
shared k^R (kv_a) and unclipped heads are untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import K3Config
from k3jax.layers.mla import MLA
from k3jax.model import layer_view, layout, mla_dims, restack, unstack
from k3jax.optim.qk_clip import clip_factors, clip_mla, qk_clip

DIMS = dict(mla_num_heads=3, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            mla_output_gate=True)


def _cfg(q_lora: bool, **kw) -> K3Config:
    """Layer 1 (0-based) is the only MLA layer unless ``kw`` says otherwise; MLA dims as in ``_mla``."""
    base = dict(name="qk-clip", hidden_size=32, num_layers=2, full_attn_layers=(2,),
                q_lora_rank=16 if q_lora else None, **DIMS)
    return K3Config(**{**base, **kw})


def _mla(q_lora: bool, seed: int = 0):
    blk = MLA(d=32, num_heads=3, q_lora_rank=16 if q_lora else None, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=8, output_gate=True, rngs=nnx.Rngs(seed))
    return nnx.graphdef(blk), nnx.state(blk, nnx.Param).to_pure_dict()


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_b", "wq"])
def test_forced_large_logit_is_clipped_to_tau(q_lora):
    gd, p = _mla(q_lora)
    qkey = "q_b" if q_lora else "wq"
    p[qkey] = p[qkey].at[:, 1, :].multiply(400.0)  # head 1 gets huge logits
    p["kv_b"] = p["kv_b"].at[:, 1, :8].multiply(20.0)
    x = jax.random.normal(jax.random.key(1), (2, 12, 32), jnp.float32)
    _, ml = nnx.merge(gd, p)(x, norm_eps=1e-6, block_size=4)
    s = np.asarray(jnp.max(ml, axis=0))
    tau = 5.0
    assert s[1] > 10 * tau and s[0] < tau and s[2] < tau, s
    cfg = _cfg(q_lora)
    assert cfg.mla_layers == (1,)
    params = restack({"layers": [{"kda": {}}, {"mla": p}]}, cfg)
    new, info = qk_clip(params, [ml], cfg, tau=tau)
    q = layer_view(new, cfg, 1)["mla"]
    _, ml2 = nnx.merge(gd, q)(x, norm_eps=1e-6, block_size=4)
    s2 = np.asarray(jnp.max(ml2, axis=0))
    np.testing.assert_allclose(s2[1], tau, rtol=1e-5)
    np.testing.assert_array_equal(s2[[0, 2]], s[[0, 2]])  # other heads: bit-identical
    assert info["clipped"].tolist() == [[False, True, False]]
    N, Hn, Hr, V = nnx.merge(gd, p).dims
    assert (N, Hn, Hr, V) == mla_dims(cfg)
    np.testing.assert_array_equal(q["kv_b"][:, :, Hn:], p["kv_b"][:, :, Hn:])  # v columns untouched
    np.testing.assert_array_equal(q["kv_a"], p["kv_a"])  # shared k^R untouched
    assert sorted(q) == sorted(p)
    for k in p:
        if k not in (qkey, "kv_b"):
            np.testing.assert_array_equal(q[k], p[k])
    g = float(info["gamma"][0, 1])
    np.testing.assert_allclose(q[qkey][:, 1, :Hn], p[qkey][:, 1, :Hn] * np.sqrt(g), rtol=1e-6)
    np.testing.assert_allclose(q[qkey][:, 1, Hn:], p[qkey][:, 1, Hn:] * g, rtol=1e-6)
    np.testing.assert_allclose(q["kv_b"][:, 1, :Hn], p["kv_b"][:, 1, :Hn] * np.sqrt(g), rtol=1e-6)
    np.testing.assert_array_equal(q[qkey][:, [0, 2]], p[qkey][:, [0, 2]])


def test_stacked_mla_layers_clip_like_unstacked():
    """MLA layers stored in the stacked groups (leading [G] axis) get the per-layer clip of their own max logits."""
    cfg = _cfg(True, num_layers=4, full_attn_layers=(2, 4), first_k_dense_replace=0)
    lay = layout(cfg)
    assert lay.groups == 2 and lay.period == 2 and lay.stacked_layers(1) == (1, 3)  # both MLA layers stacked
    (_, p1), (_, p3) = _mla(True, 0), _mla(True, 1)
    params = restack({"layers": [{"kda": {}}, {"mla": p1}, {"kda": {}}, {"mla": p3}]}, cfg)
    assert params["groups"]["layers"][1]["mla"]["kv_b"].shape[0] == 2
    ml = [jnp.array([[1.0, 50.0, 2.0], [3.0, 40.0, 1.0]]), jnp.array([1.0, 2.0, 8.0])]  # [..., N] per MLA layer
    new, info = qk_clip(params, ml, cfg, tau=5.0)
    assert info["clipped"].tolist() == [[False, True, False], [False, False, True]]
    np.testing.assert_allclose(info["gamma"], [[1.0, 0.1, 1.0], [1.0, 1.0, 5.0 / 8.0]], rtol=1e-6)
    view = unstack(new, cfg)
    dims = mla_dims(cfg)
    for l, p, g in ((1, p1, info["gamma"][0]), (3, p3, info["gamma"][1])):
        want = clip_mla(p, g, dims)
        assert sorted(view["layers"][l]["mla"]) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(view["layers"][l]["mla"][k], want[k], err_msg=f"layer {l} {k}")


def test_no_clip_below_tau_and_switch_off_by_threshold():
    gamma, clipped = clip_factors(jnp.array([1.0, 100.0, 250.0]), 100.0)
    assert clipped.tolist() == [False, False, True]
    np.testing.assert_allclose(gamma, [1.0, 1.0, 0.4])


def test_layer_count_mismatch_is_an_error():
    cfg = _cfg(True)
    params = restack({"layers": [{"kda": {}}, {"mla": _mla(True)[1]}]}, cfg)
    with pytest.raises(ValueError, match="MLA layers"):
        qk_clip(params, [], cfg, tau=1.0)
