"""KDA ladder (docs/design.md §3.2): fp64 NumPy oracle -> recurrent -> chunked, plus decode, layout and input checks.

Shapes use the k3jax/notation.py letters: [B, T, N, K] with N heads.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda
from k3jax.reference import kda as ref
from k3jax.testing import TOL, assert_close

ARGS = ("q", "k", "v", "g", "beta")


def as_jax(d, dtype=jnp.float32):
    return {name: jnp.asarray(val, dtype) for name, val in d.items()}


def bound_for(gate):
    return None if gate in ("softplus", "extreme") else -5.0


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_recurrent_matches_fp64_oracle(gate):
    x = ref.random_inputs(0, B=2, T=65, N=3, K=60, V=48, gate=gate)
    o_ref, s_ref = ref.kda_recurrent(*(x[a] for a in ARGS), initial_state=x["h0"])
    j = as_jax(x)
    o, s = kda.kda_recurrent(*(j[a] for a in ARGS), initial_state=j["h0"])
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert_close(o, o_ref, TOL["fp32_vs_fp64"], name="o")
    assert_close(s, s_ref, TOL["fp32_vs_fp64"], name="state")


def test_featurisation_matches_fp64_oracle():
    """gates.py against k3jax.reference.kda: both gates, the causal conv (one shot and streamed), the L2 norm."""
    rng = np.random.default_rng(13)
    B, T, N, K, Wc = 2, 9, 3, 8, 4
    raw = 4.0 * rng.standard_normal((B, T, N, K))
    dt_bias, A_log = rng.standard_normal((N, K)), np.log(rng.uniform(1, 16, N))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    assert_close(kda.gate_safe(f32(raw), f32(dt_bias), f32(A_log), -5.0),
                 ref.gate_safe(raw, dt_bias, A_log, -5.0), TOL["fp32_vs_fp64"], name="gate_safe")
    assert_close(kda.gate_softplus(f32(raw), f32(dt_bias), f32(A_log)),
                 ref.gate_softplus(raw, dt_bias, A_log), TOL["fp32_vs_fp64"], name="gate_softplus")
    u, w = rng.standard_normal((B, T, N * K)), rng.standard_normal((N * K, Wc))
    y_ref, tail_ref = ref.short_conv(u, w)
    y, tail = kda.causal_conv_silu(f32(u), f32(w))
    assert_close(y, y_ref, TOL["fp32_vs_fp64"], name="conv")
    assert_close(tail, tail_ref, TOL["fp32_vs_fp64"], name="conv tail")
    y1, t1 = kda.causal_conv_silu(f32(u[:, :5]), f32(w))
    y2, t2 = kda.causal_conv_silu(f32(u[:, 5:]), f32(w), t1)
    assert_close(jnp.concatenate([y1, y2], axis=1), y_ref, TOL["fp32_vs_fp64"], name="conv streamed")
    assert_close(t2, tail_ref, TOL["fp32_vs_fp64"], name="conv streamed tail")
    assert_close(kda.l2norm(f32(raw)), ref.l2norm(raw), TOL["fp32_vs_fp64"], name="l2norm")
    with pytest.raises(ValueError, match="conv cache"):
        kda.causal_conv_silu(f32(u), f32(w), t1[:, :1])


# One head per gate family: the bounded path sees the saturating safe gate, g = lb exactly and g = 0; the
# unbounded path sees softplus gates (A_log = log U(1, 16), raw scaled by 1/4/8), hard resets (-1000) and g = 0.
FAMILIES = {"bounded": ("safe", "bound", "zero"), "unbounded": ("softplus", "extreme", "zero")}


@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 257])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_chunked_matches_recurrent_fp32(T, gate):
    x = ref.random_inputs(T, B=1, T=T, N=3, K=60, V=32, gate=FAMILIES[gate])
    j = as_jax(x)
    o_rec, s_rec = kda.kda_recurrent(*(j[a] for a in ARGS), initial_state=j["h0"])
    o, s = kda.kda_chunked(*(j[a] for a in ARGS), initial_state=j["h0"],
                           gate_lower_bound=-5.0 if gate == "bounded" else None)
    assert o.shape == (1, T, 3, 32) and s.shape == (1, 3, 60, 32)
    assert_close(o, o_rec, TOL["fp32_vs_fp64"], name=f"o T={T} {gate}")
    assert_close(s, s_rec, TOL["fp32_vs_fp64"], name=f"state T={T} {gate}")
    if T in (17, 257):  # and against the oracle itself
        o_ref, s_ref = ref.kda_recurrent(*(x[a] for a in ARGS), initial_state=x["h0"])
        assert_close(o, o_ref, TOL["fp32_vs_fp64"], name="o vs oracle")
        assert_close(s, s_ref, TOL["fp32_vs_fp64"], name="state vs oracle")


@pytest.mark.parametrize("gate", ["safe", "extreme"])
def test_chunked_grads_match_recurrent(gate):
    x = ref.random_inputs(3, B=1, T=70, N=2, K=60, V=32, gate=gate)
    j = as_jax(x)
    rng = np.random.default_rng(1)
    w_o = jnp.asarray(rng.standard_normal((1, 70, 2, 32)), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal((1, 2, 60, 32)), jnp.float32)
    lb = bound_for(gate)

    def loss(fn, q, k, v, g, beta, h0):
        o, s = fn(q, k, v, g, beta, initial_state=h0)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    chunked = lambda *a, **kw: kda.kda_chunked(*a, gate_lower_bound=lb, **kw)  # noqa: E731
    names = (*ARGS, "h0")
    args = [j[a] for a in names]
    g_rec = jax.jit(jax.grad(lambda *a: loss(kda.kda_recurrent, *a), argnums=range(6)))(*args)
    g_chk = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=range(6)))(*args)
    for name, a, b in zip(names, g_chk, g_rec):
        assert_close(a, b, TOL["fp32_grad"], name=f"d{name}")


@pytest.mark.parametrize("gate", ["safe", "extreme"])
def test_chunked_fp64_matches_recurrent(x64, gate):
    x = ref.random_inputs(4, B=1, T=100, N=2, K=60, V=32, gate=gate)
    j = as_jax(x, jnp.float64)
    o_rec, s_rec = kda.kda_recurrent(*(j[a] for a in ARGS), initial_state=j["h0"])
    o, s = kda.kda_chunked(*(j[a] for a in ARGS), initial_state=j["h0"], gate_lower_bound=bound_for(gate))
    assert o.dtype == jnp.float64 and s.dtype == jnp.float64
    o_ref, s_ref = ref.kda_recurrent(*(x[a] for a in ARGS), initial_state=x["h0"])
    assert_close(o, o_rec, TOL["fp64_vs_fp64"], name="o")
    assert_close(s, s_rec, TOL["fp64_vs_fp64"], name="state")
    assert_close(o, o_ref, TOL["fp64_vs_fp64"], name="o vs oracle")
    assert_close(s, s_ref, TOL["fp64_vs_fp64"], name="state vs oracle")


@pytest.mark.parametrize("T", [15, 16, 17, 63, 64, 65])
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_chunked_is_causal_bit_identical(T, gate):
    x = ref.random_inputs(5, B=1, T=T, N=2, K=60, V=32, gate=gate)
    y = ref.random_inputs(6, B=1, T=T, N=2, K=60, V=32, gate=gate)
    f = jax.jit(lambda q, k, v, g, beta: kda.kda_chunked(q, k, v, g, beta, gate_lower_bound=bound_for(gate))[0])
    base = np.asarray(f(*(jnp.asarray(x[a], jnp.float32) for a in ARGS)))
    for P in sorted({1, T // 2, T - 1, 16, 17} & set(range(1, T))):
        mixed = [np.concatenate([x[a][:, :P], y[a][:, P:]], axis=1) for a in ARGS]
        out = np.asarray(f(*(jnp.asarray(m, jnp.float32) for m in mixed)))
        assert np.array_equal(out[:, :P], base[:, :P]), f"T={T} P={P}: outputs before P changed"
        assert not np.array_equal(out[:, P:], base[:, P:])


def test_extreme_gates_no_nan_under_debug_nans():
    x = ref.random_inputs(7, B=1, T=40, N=1, K=20, V=8, gate="extreme")
    j = as_jax(x)
    prev = jax.config.jax_debug_nans
    jax.config.update("jax_debug_nans", True)
    try:
        o, s = kda.kda_chunked(*(j[a] for a in ARGS), initial_state=j["h0"])
        grads = jax.grad(lambda *a: jnp.sum(kda.kda_chunked(*a)[0]), argnums=range(5))(*(j[a] for a in ARGS))
    finally:
        jax.config.update("jax_debug_nans", prev)
    for arr in (o, s, *grads):
        assert np.all(np.isfinite(np.asarray(arr)))


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_chunked_prefill_then_step_decode_matches_one_shot(gate):
    T, P = 40, 33
    x = ref.random_inputs(8, B=2, T=T, N=2, K=60, V=32, gate=gate)
    j = as_jax(x)
    o_full, s_full = kda.kda_recurrent(*(j[a] for a in ARGS), initial_state=j["h0"])
    o_pre, S = kda.kda_chunked(*(j[a][:, :P] for a in ARGS), initial_state=j["h0"], chunk_size=16,
                               gate_lower_bound=bound_for(gate))
    outs = [o_pre]
    for t in range(P, T):
        o_t, S = kda.kda_step(*(j[a][:, t] for a in ARGS), S)
        outs.append(o_t[:, None])
    o_t1, _ = kda.kda_step(*(j[a][:, T - 1:T] for a in ARGS), S)  # T = 1 form keeps the time axis
    assert o_t1.shape == (2, 1, 2, 32)
    assert_close(jnp.concatenate(outs, axis=1), o_full, TOL["fp32_vs_fp64"], name="o")
    assert_close(S, s_full, TOL["fp32_vs_fp64"], name="state")


def test_state_layout_round_trip_and_v_first_read():
    x = ref.random_inputs(9, B=2, T=9, N=3, K=8, V=5)
    _, S = ref.kda_recurrent(*(x[a] for a in ARGS), initial_state=x["h0"])
    S_kf = jnp.asarray(S, jnp.float32)
    S_vf = kda.state_k_first_to_v_first(S_kf)
    assert S_vf.shape == (2, 3, 5, 8)
    np.testing.assert_array_equal(np.asarray(kda.state_v_first_to_k_first(S_vf)), np.asarray(S_kf))
    # A V-first consumer reads o = S' q; that must equal the K-first read S^T q (S_vf is S rounded to fp32).
    qv = np.asarray(x["q"][:, 0])
    assert_close(np.einsum("bnvk,bnk->bnv", np.asarray(S_vf), qv), np.einsum("bnkv,bnk->bnv", S, qv),
                 TOL["fp32_vs_fp64"], name="V-first read")


def test_bf16_inputs_fp32_state_close_to_fp32():
    x = ref.random_inputs(10, B=1, T=100, N=2, K=64, V=64, gate="safe")
    j32, j16 = as_jax(x), as_jax(x, jnp.bfloat16)
    o32, s32 = kda.kda_chunked(*(j32[a] for a in ARGS), initial_state=j32["h0"], gate_lower_bound=-5.0)
    o16, s16 = kda.kda_chunked(*(j16[a] for a in ARGS), initial_state=j32["h0"], gate_lower_bound=-5.0)
    assert o16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32
    assert_close(o16, o32, TOL["bf16"], name="o")
    assert_close(s16, s32, TOL["bf16"], name="state")


def _bad_cases():
    x = as_jax(ref.random_inputs(11, B=1, T=5, N=2, K=4, V=3))
    good = {a: x[a] for a in ARGS}
    yield "q", {**good, "q": x["q"][0]}
    yield "k", {**good, "k": x["k"][..., :3]}
    yield "v", {**good, "v": x["v"][:, :4]}
    yield "g", {**good, "g": jnp.abs(x["g"]) + 0.1}
    yield "beta", {**good, "beta": x["beta"] + 1.5}
    yield "beta", {**good, "beta": x["beta"][..., None]}
    yield "dtype", {**good, "v": x["v"].astype(jnp.bfloat16)}
    yield "g", {**good, "g": x["g"].astype(jnp.int32)}


@pytest.mark.parametrize("fn", ["recurrent", "chunked"])
def test_bad_inputs_raise_value_error_naming_the_argument(fn):
    f = kda.kda_recurrent if fn == "recurrent" else kda.kda_chunked
    for name, args in _bad_cases():
        with pytest.raises(ValueError, match=name if name != "dtype" else "dtype"):
            f(*(args[a] for a in ARGS))
    x = as_jax(ref.random_inputs(11, B=1, T=5, N=2, K=4, V=3))
    with pytest.raises(ValueError, match="initial_state"):
        f(*(x[a] for a in ARGS), initial_state=x["h0"][..., :2])
    with pytest.raises(ValueError, match="initial_state"):
        f(*(x[a] for a in ARGS), initial_state=x["h0"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="gate_lower_bound"):
        kda.kda_chunked(*(x[a] for a in ARGS), gate_lower_bound=-0.5)
    with pytest.raises(ValueError, match="state"):
        kda.kda_step(*(x[a][:, 0] for a in ARGS), x["h0"][:, :1])


def test_check_chunking_rejects_bad_tiling():
    kda.check_chunking(64, 16, -5.0)
    kda.check_chunking(48, 16, None)
    with pytest.raises(ValueError, match="multiple of sub_chunk"):
        kda.check_chunking(40, 16, None)
    with pytest.raises(ValueError, match="must be negative"):
        kda.check_chunking(64, 16, 0.0)
    with pytest.raises(ValueError, match="126"):  # |lb| (c - 1) / ln 2 = 5 * 31 / 0.69 = 224 log2 units
        kda.check_chunking(64, 32, -5.0)
    x = as_jax(ref.random_inputs(12, B=1, T=5, N=2, K=4, V=3))
    with pytest.raises(ValueError, match="multiple of sub_chunk"):
        kda.kda_chunked(*(x[a] for a in ARGS), chunk_size=24)


@pytest.mark.slow
def test_long_sequence_grad_memory_is_per_chunk():
    """T = 65536, N = 2, K = V = 64: forward + backward temp memory must scale with per-chunk states
    and groups (measured 155 MiB on CPU), far below per-token states (2 GiB)."""
    B, T, N, K = 1, 65536, 2, 64
    sds = jax.ShapeDtypeStruct
    shapes = [sds((B, T, N, K), jnp.float32)] * 4 + [sds((B, T, N), jnp.float32)]

    def loss(q, k, v, g, beta):
        return jnp.sum(kda.kda_chunked(q, k, v, g, beta, gate_lower_bound=-5.0)[0])

    compiled = jax.jit(jax.grad(loss, argnums=range(5))).lower(*shapes).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    per_token_states = T * N * K * K * 4
    assert temp < per_token_states / 8, f"temp {temp / 2**20:.0f} MiB"


# --------------------------------------------------------------------------- packed documents (docs/model.md §4.7)

# Per row, the first token of each document: boundaries mid-chunk, at a chunk start (64, 16), on the last token,
# length-1 documents and a row that is one document. T = 150 is not a multiple of the chunk.
DOC_STARTS = ([0, 1, 2, 40, 64, 65, 128, 149], [0, 70, 71, 140], [0])


def _packed(seed, gate, dtype=np.float64):
    B, T = len(DOC_STARTS), 150
    x = ref.random_inputs(seed, B=B, T=T, N=2, K=32, V=16, gate=gate)
    seg = np.zeros((B, T), np.int32)
    for b, starts in enumerate(DOC_STARTS):
        for i, a in enumerate(starts):
            seg[b, a:] = 7 * i + 3          # any labelling: only changes between neighbours count
    return x, seg


def _each_alone(x):
    """The fp64 oracle on every document by itself (zero state; the row's first document continues h0)."""
    B, T = x["q"].shape[:2]
    o = np.zeros(x["v"].shape)
    finals = []
    for b, starts in enumerate(DOC_STARTS):
        bounds = [*starts, T]
        for a, e in zip(bounds[:-1], bounds[1:], strict=True):
            h0 = x["h0"][b:b + 1] if a == 0 else None
            o[b:b + 1, a:e], s = ref.kda_recurrent(*(x[n][b:b + 1, a:e] for n in ARGS), initial_state=h0)
        finals.append(s[0])
    return o, np.stack(finals)


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_packed_documents_equal_each_document_alone(gate):
    """recurrent and chunked (C = 16, 64) with segment_ids == the fp64 oracle run on each document by itself."""
    x, seg = _packed(21, gate)
    o_ref, s_ref = _each_alone(x)
    j = as_jax(x)
    o, s = kda.kda_recurrent(*(j[a] for a in ARGS), initial_state=j["h0"], segment_ids=jnp.asarray(seg))
    assert_close(o, o_ref, TOL["fp32_vs_fp64"], name="recurrent o")
    assert_close(s, s_ref, TOL["fp32_vs_fp64"], name="recurrent state")
    for C in (16, 64):
        o, s = kda.kda_chunked(*(j[a] for a in ARGS), initial_state=j["h0"], segment_ids=jnp.asarray(seg),
                               chunk_size=C, gate_lower_bound=bound_for(gate))
        assert_close(o, o_ref, TOL["fp32_vs_fp64"], name=f"chunked o C={C}")
        assert_close(s, s_ref, TOL["fp32_vs_fp64"], name=f"chunked state C={C}")


def test_packed_documents_fp64_exact(x64):
    x, seg = _packed(22, "safe")
    o_ref, s_ref = _each_alone(x)
    j = as_jax(x, jnp.float64)
    o, s = kda.kda_chunked(*(j[a] for a in ARGS), initial_state=j["h0"], segment_ids=jnp.asarray(seg),
                           gate_lower_bound=-5.0)
    assert_close(o, o_ref, TOL["fp64_vs_fp64"], name="o")
    assert_close(s, s_ref, TOL["fp64_vs_fp64"], name="state")


def test_packed_documents_chunked_grads_match_recurrent():
    x, seg = _packed(23, "safe")
    j = as_jax(x)
    seg = jnp.asarray(seg)
    rng = np.random.default_rng(2)
    w_o = jnp.asarray(rng.standard_normal(x["v"].shape), jnp.float32)
    w_s = jnp.asarray(rng.standard_normal(x["h0"].shape), jnp.float32)

    def loss(fn, *a):
        o, s = fn(*a[:5], initial_state=a[5], segment_ids=seg)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    chunked = lambda *a, **kw: kda.kda_chunked(*a, gate_lower_bound=-5.0, chunk_size=16, **kw)  # noqa: E731
    names = (*ARGS, "h0")
    args = [j[a] for a in names]
    g_rec = jax.jit(jax.grad(lambda *a: loss(kda.kda_recurrent, *a), argnums=range(6)))(*args)
    g_chk = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=range(6)))(*args)
    for name, a, b in zip(names, g_chk, g_rec, strict=True):
        assert_close(a, b, TOL["fp32_grad"], name=f"d{name}")


def test_packed_conv_restarts_at_each_document():
    """causal_conv_silu with run ids == the fp64 conv on each document alone (the tail feeds the first only)."""
    rng = np.random.default_rng(24)
    B, T, X, Wc = 2, 12, 6, 4
    u, w, tail = rng.standard_normal((B, T, X)), rng.standard_normal((X, Wc)), rng.standard_normal((B, Wc - 1, X))
    starts = ([0, 1, 5, 11], [0, 2, 3])
    seg = np.zeros((B, T), np.int32)
    want = np.zeros((B, T, X))
    for b, st in enumerate(starts):
        bounds = [*st, T]
        for i, (a, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seg[b, a:e] = i
            want[b:b + 1, a:e] = ref.short_conv(u[b:b + 1, a:e], w, tail[b:b + 1] if a == 0 else None)[0]
    from k3jax.ops.segments import runs

    y, _ = kda.causal_conv_silu(jnp.asarray(u, jnp.float32), jnp.asarray(w, jnp.float32),
                                jnp.asarray(tail, jnp.float32), run=runs(jnp.asarray(seg)))
    assert_close(y, want, TOL["fp32_vs_fp64"], name="conv")
