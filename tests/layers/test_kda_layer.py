"""KDA token mixer (docs/model.md §4.1) against the float64 NumPy layer oracle; impls agree; cache round trips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers.kda import KDA
from k3jax.reference import kda as ref
from k3jax.testing import TOL, assert_close

D, N, K = 32, 2, 16
EPS = 1e-5


def params(blk) -> dict:
    """The block's parameter dict (what the float64 oracle takes)."""
    return nnx.state(blk, nnx.Param).to_pure_dict()


def with_params(blk, p: dict):
    """A block of ``blk``'s structure holding the parameter dict ``p``."""
    return nnx.merge(nnx.graphdef(blk), p)


def make(gate_lower_bound, full_rank, dtype=jnp.float32, seed=0):
    blk = KDA(d=D, num_heads=N, head_dim=K, conv_size=4, full_rank_gate=full_rank,
              gate_lower_bound=gate_lower_bound, dtype=dtype, rngs=nnx.Rngs(seed))
    if gate_lower_bound is None:  # push some gates far out so the unbounded path sees large decays
        push = 4.0 * jax.random.normal(jax.random.PRNGKey(7), blk.dt_bias.shape, blk.dt_bias.dtype)
        blk.dt_bias[...] = blk.dt_bias[...] + push
    return blk


def to_f64(blk):
    return with_params(blk, jax.tree.map(lambda a: a.astype(jnp.float64), params(blk)))


def x_input(B=2, T=37, dtype=jnp.float32, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, D), dtype)


@pytest.mark.parametrize("full_rank", [True, False], ids=["full_rank_gate", "low_rank_gate"])
@pytest.mark.parametrize("lb", [-5.0, None], ids=["safe_gate", "softplus_gate"])
def test_layer_fp32_matches_fp64_oracle_all_impls(lb, full_rank):
    blk, x = make(lb, full_rank), x_input()
    y_ref, c_ref = ref.kda_layer(params(blk), x, gate_lower_bound=lb, eps=EPS)
    for impl in ("recurrent", "chunked", "pallas"):
        y, c = blk(x, eps=EPS, impl=impl, chunk_size=32)
        assert y.dtype == jnp.float32 and y.shape == x.shape
        assert_close(y, y_ref, TOL["fp32_vs_fp64"], name=f"y {impl}")
        assert_close(c["state"], c_ref["state"], TOL["fp32_vs_fp64"], name=f"state {impl}")
        for name in ("conv_q", "conv_k", "conv_v"):
            assert c[name].shape == (2, 3, N * K)
            assert_close(c[name], c_ref[name], TOL["fp32_vs_fp64"], name=name)


@pytest.mark.parametrize("lb,full_rank", [pytest.param(-5.0, True, marks=pytest.mark.slow),  # CI's budget
                                          (-5.0, False), (None, True), (None, False)],
                         ids=["safe_gate-full_rank_gate", "safe_gate-low_rank_gate", "softplus_gate-full_rank_gate",
                              "softplus_gate-low_rank_gate"])
def test_layer_fp64_matches_oracle(x64, lb, full_rank):
    blk = to_f64(make(lb, full_rank))
    x = x_input().astype(jnp.float64)
    y_ref, c_ref = ref.kda_layer(params(blk), x, gate_lower_bound=lb, eps=EPS)
    for impl in ("recurrent", "chunked"):
        y, c = blk(x, eps=EPS, impl=impl, chunk_size=32)
        assert y.dtype == jnp.float64
        assert_close(y, y_ref, TOL["fp64_vs_fp64"], name=f"y {impl}")
        assert_close(c["state"], c_ref["state"], TOL["fp64_vs_fp64"], name=f"state {impl}")


@pytest.mark.parametrize("lb", [pytest.param(-5.0, marks=pytest.mark.slow), None],  # CI's budget: softplus stays
                         ids=["safe_gate", "softplus_gate"])
def test_layer_prefill_then_decode_matches_one_shot(lb):
    """Chunked prefill of P tokens, a T > 1 continuation, then T = 1 decode steps == the one-shot forward."""
    blk, x = make(lb, True), x_input(T=30)
    y_full, c_full = blk(x, eps=EPS, impl="chunked", chunk_size=16)
    y_ref, _ = ref.kda_layer(params(blk), x, gate_lower_bound=lb, eps=EPS)
    assert_close(y_full, y_ref, TOL["fp32_vs_fp64"], name="one-shot vs oracle")
    ys = []
    y, cache = blk(x[:, :19], eps=EPS, impl="chunked", chunk_size=16)
    ys.append(y)
    y, cache = blk(x[:, 19:26], eps=EPS, impl="chunked", chunk_size=16, cache=cache)
    ys.append(y)
    for t in range(26, 30):
        y, cache = blk(x[:, t:t + 1], eps=EPS, impl="chunked", cache=cache)
        ys.append(y)
    assert_close(jnp.concatenate(ys, axis=1), y_full, TOL["fp32_vs_fp64"], name="prefill + decode")
    for name in ("state", "conv_q", "conv_k", "conv_v"):
        assert_close(cache[name], c_full[name], TOL["fp32_vs_fp64"], name=name)


def test_layer_decode_fp64_matches_oracle(x64):
    blk = to_f64(make(-5.0, False))
    x = x_input(T=12).astype(jnp.float64)
    y_ref, _ = ref.kda_layer(params(blk), x, gate_lower_bound=-5.0, eps=EPS)
    y0, cache = blk(x[:, :9], eps=EPS, impl="chunked", chunk_size=16)
    ys = [y0]
    for t in range(9, 12):
        y, cache = blk(x[:, t:t + 1], eps=EPS, cache=cache)
        ys.append(y)
    assert_close(jnp.concatenate(ys, axis=1), y_ref, TOL["fp64_vs_fp64"], name="prefill + decode fp64")


def test_layer_bf16_close_to_fp32():
    b32, x32 = make(-5.0, True), x_input()
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim == 3 or a.shape == (D, K) or a.shape == (D, N)
                       else a, params(b32))
    b16 = with_params(b32, p16)
    # the same dtype split as a block built with dtype=bfloat16 (convs, dt_bias, A_log, o_norm stay float32)
    ref16 = KDA(d=D, num_heads=N, head_dim=K, conv_size=4, full_rank_gate=True, gate_lower_bound=-5.0,
                dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert jax.tree.map(lambda a: a.dtype, p16) == jax.tree.map(lambda a: a.dtype, params(ref16))
    y32, _ = b32(x32, eps=EPS, impl="chunked", chunk_size=32)
    y16, c16 = b16(x32.astype(jnp.bfloat16), eps=EPS, impl="chunked", chunk_size=32)
    assert y16.dtype == jnp.bfloat16 and c16["state"].dtype == jnp.float32
    assert_close(y16, y32, TOL["bf16"], name="y bf16")


def test_layer_rejects_bad_impl_and_input():
    blk, x = make(-5.0, True), x_input()
    with pytest.raises(ValueError, match="impl"):
        blk(x, eps=EPS, impl="flash")
    with pytest.raises(ValueError, match="x"):
        blk(x[0], eps=EPS)
    with pytest.raises(ValueError, match="conv cache"):
        _, cache = blk(x[:, :5], eps=EPS)
        cache["conv_q"] = cache["conv_q"][:, :2]
        blk(x[:, 5:6], eps=EPS, cache=cache)
    assert np.isfinite(np.asarray(blk(x, eps=EPS)[0])).all()
