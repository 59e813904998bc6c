"""Per-expert LoRA over the routed experts (``experts_lora``): a float64 NumPy reference of the
LoRA FFN, B = 0 against the plain experts, QLoRA (packed MXFP4 base) against LoRA over the dequantized stacks, and the
CPU tile loop against the grouped path (``lax.ragged_dot`` / the Pallas grouped MXFP4 kernel in its interpreter)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.backends import mxfp4_gmm
from k3jax.ops import mx
from k3jax.ops.activations import glu_activation
from k3jax.ops.grouped_matmul import experts_dense, experts_sorted
from k3jax.ops.lora import LoraWeight
from k3jax.ops.lora_experts import experts_lora
from k3jax.ops.packed_experts import PackedWeight, dequantize_stack, experts_packed
from k3jax.testing import TOL, assert_close

ACT = partial(glu_activation, act="silu")  # silu(a) · b: simple to write in NumPy
M, A, E, Pd, F, R = 32, 2, 8, 32, 64, 4
AQ = partial(mx.fake_quant_mxfp8, axis=-1)


def packed_stacks(rng, shapes):
    """Random MXFP4 stacks (``PackedWeight``: any fp4 codes, E8M0 scales 2^-5 … 2^-3) for float shapes [E, in, out],
    and their dequantized floats: the bytes straight from NumPy, no quantizer to compile."""
    packed = tuple(PackedWeight(jnp.asarray(rng.integers(0, 256, (e, o, i // 2), np.uint8)),
                                jnp.asarray(rng.integers(122, 125, (e, o, i // 32), np.uint8))) for e, i, o in shapes)
    return packed, jax.jit(lambda ws: tuple(dequantize_stack(w) for w in ws))(packed)


@pytest.fixture(scope="module")
def problem():
    """Rows, routing (expert 3 on every token, expert 0 on none), gates, packed stacks, their dequantized floats, and
    per-expert factors A [E, in, r], B [E, r, out] (B nonzero: the adapter path counts). NumPy-drawn."""
    rng = np.random.default_rng(0)
    shapes = ((E, Pd, F), (E, Pd, F), (E, F, Pd))
    packed, floats = packed_stacks(rng, shapes)
    a = tuple(jnp.asarray(rng.standard_normal((E, s[1], R)) / np.sqrt(s[1]), jnp.float32) for s in shapes)
    b = tuple(jnp.asarray(0.5 * rng.standard_normal((E, R, s[2])), jnp.float32) for s in shapes)
    z = jnp.asarray(rng.standard_normal((M, Pd)), jnp.float32)
    ids = jnp.asarray(np.stack([np.full(M, 3), rng.choice([1, 2, 4, 5, 6, 7], M)], axis=1), jnp.int32)
    g = np.exp(rng.standard_normal((M, A)))
    wts = jnp.asarray(g / g.sum(-1, keepdims=True), jnp.float32)
    return z, ids, wts, packed, floats, a, b


@pytest.fixture(scope="module")
def ct(problem):
    """A fixed cotangent of the outputs: the VJP itself, not a loss's amplification."""
    return jnp.asarray(np.random.default_rng(1).standard_normal(problem[0].shape), jnp.float32)


def _reference(z, ids, wts, ws, a, b):
    """Every token through its top-k experts, one (token, slot) at a time, in float64."""
    z, wts = np.asarray(z, np.float64), np.asarray(wts, np.float64)
    ws, a, b = ([np.asarray(x, np.float64) for x in t] for t in (ws, a, b))
    y = np.zeros_like(z)
    for m in range(z.shape[0]):
        for s, e in enumerate(np.asarray(ids[m])):
            x = z[m]
            g = x @ ws[0][e] + (x @ a[0][e]) @ b[0][e]
            u = x @ ws[1][e] + (x @ a[1][e]) @ b[1][e]
            h = g / (1.0 + np.exp(-g)) * u
            y[m] += wts[m, s] * (h @ ws[2][e] + (h @ a[2][e]) @ b[2][e])
    return y


def _stacks(ws, a, b):
    return tuple(LoraWeight(*t) for t in zip(ws, a, b, strict=True))


def _fwd_grad(fn, z, ids, wts, ws, a, b, ct):
    """fn's output and the gradients of <ct, fn> w.r.t. the rows z and the factors A, B (a fixed cotangent)."""
    def f(z, a, b):
        return fn(z, ids, wts, *_stacks(ws, a, b), ACT)

    def both(z, a, b):
        y, vjp = jax.vjp(f, z, a, b)
        return y, vjp(ct)

    return jax.jit(both)(z, a, b)


def _check(got, ref, tol, what):
    (y, (dz, da, db)), (y_ref, (dz_ref, da_ref, db_ref)) = got, ref
    errs = {"fwd": assert_close(y, y_ref, tol, name=f"{what} fwd"),
            "dz": assert_close(dz, dz_ref, tol, name=f"{what} dz")}
    for i in range(3):
        errs[f"dA{i}"] = assert_close(da[i], da_ref[i], tol, name=f"{what} dA{i}")
        errs[f"dB{i}"] = assert_close(db[i], db_ref[i], tol, name=f"{what} dB{i}")
    return errs


@pytest.mark.parametrize("base,impl", [("float", "tiles"), ("float", "grouped"), ("packed", "tiles")])
def test_experts_lora_equals_float64_numpy_reference(problem, base, impl):
    """f32 (fp32_shallow; seen ≤ 2.2e-7) against the per-token float64 loop, both bases and both base-product paths
    (the packed grouped one is compared with its tile loop below)."""
    z, ids, wts, packed, floats, a, b = problem
    ws = packed if base == "packed" else floats
    y = jax.jit(partial(experts_lora, act=ACT, impl=impl))(z, ids, wts, *_stacks(ws, a, b))
    assert_close(y, _reference(z, ids, wts, floats, a, b), TOL["fp32_shallow"], name=f"{base}-{impl}")


def test_zero_b_equals_plain_experts(problem, ct):
    """B = 0 (a fresh adapter): the plain experts' outputs and row gradients — float base against ``experts_sorted``,
    packed base against ``experts_packed`` (same products, another summation order: fp32_shallow; seen ≤ 1.5e-7)."""
    z, ids, wts, packed, floats, a, _ = problem
    zero = tuple(jnp.zeros((E, R, w.shape[-1])) for w in floats)

    def fwd_dz(f):
        y, vjp = jax.vjp(f, z)
        return y, vjp(ct)[0]

    for ws, plain in ((floats, experts_sorted), (packed, partial(experts_packed, impl="tiles"))):
        y, dz = jax.jit(fwd_dz, static_argnums=0)(lambda z, ws=ws: experts_lora(z, ids, wts, *_stacks(ws, a, zero),
                                                                               ACT))
        y_ref, dz_ref = jax.jit(fwd_dz, static_argnums=0)(lambda z, ws=ws, f=plain: f(z, ids, wts, *ws, ACT))
        assert_close(y, y_ref, TOL["fp32_shallow"], name="b=0 fwd")
        assert_close(dz, dz_ref, TOL["fp32_shallow"], name="b=0 dz")


def test_adapter_gradients_follow_the_merged_weight(problem, ct):
    """An independent check of dA, dB: LoRA over W is the plain experts over W' = W + A B, so dA = dW' Bᵀ and
    dB = Aᵀ dW' with dW' the dense reference's weight gradient (``experts_dense``, another code path; f32 both,
    merged vs factored products: fp32_vs_fp64; seen ≤ 3.4e-7)."""
    z, ids, wts, _, floats, a, b = problem
    y, (dz, da, db) = _fwd_grad(experts_lora, z, ids, wts, floats, a, b, ct)
    merged = tuple(w + jnp.einsum("eir,ero->eio", ai, bi, precision="highest") for w, ai, bi in zip(floats, a, b))
    y_ref, vjp = jax.vjp(lambda z, *ws: experts_dense(z, ids, wts, *ws, ACT), z, *merged)
    dz_ref, *dw = vjp(ct)
    tol = TOL["fp32_vs_fp64"]
    assert_close(y, y_ref, tol, name="fwd")
    assert_close(dz, dz_ref, tol, name="dz")
    for i in range(3):
        assert_close(da[i], jnp.einsum("eio,ero->eir", dw[i], b[i], precision="highest"), tol, name=f"dA{i}")
        assert_close(db[i], jnp.einsum("eir,eio->ero", a[i], dw[i], precision="highest"), tol, name=f"dB{i}")


@pytest.mark.parametrize("act_quant", [None, AQ], ids=["f32", "mxfp8-acts"])
def test_packed_base_equals_dequantized_base(problem, ct, act_quant):
    """The issue's bound: LoRA over the MXFP4 bytes equals LoRA over the dequantized experts (f32, rel-RMS ≤ 1e-6 —
    fp32_shallow —, forward and the gradients w.r.t. the rows and every A, B; the CPU tile loop decodes each expert's
    bytes exactly, so the two run the same products: seen 0). With MXFP8 fake-quantized GEMM inputs too."""
    z, ids, wts, packed, floats, a, b = problem
    fn = partial(experts_lora, act_quant=act_quant, impl="tiles")
    _check(_fwd_grad(fn, z, ids, wts, packed, a, b, ct), _fwd_grad(fn, z, ids, wts, floats, a, b, ct),
           TOL["fp32_shallow"], "packed vs dequantized")


@pytest.mark.parametrize("base", ["float", "packed"])
def test_tile_loop_equals_grouped_path(problem, ct, base):
    """The base products by the CPU tile loop against the grouped path — ``lax.ragged_dot`` for a float base, the
    grouped MXFP4 kernel (``layers.backends.mxfp4_gmm``, the TPU schedule in its CPU interpreter) for a packed one,
    which the program really runs — with MXFP8 activations: forward and gradients (fp32_shallow; seen ≤ 1.3e-7). The
    grouped path runs the adapters' products grouped as well (``adapter_grouped``: two ``ragged_dot`` per stack)
    against the tile loop's gathered factors."""
    z, ids, wts, packed, floats, a, b = problem
    ws = packed if base == "packed" else floats
    gmm = partial(mxfp4_gmm, platform="tpu") if base == "packed" else None
    fn = lambda impl: partial(experts_lora, act_quant=AQ, gmm=gmm, impl=impl)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(partial(fn("grouped"), act=ACT))(z, ids, wts, *_stacks(ws, a, b)))
    assert jaxpr.count("name=mxfp4_gmm_tpu_fwd" if base == "packed" else "ragged_dot") >= 3
    assert jaxpr.count("ragged_dot") >= 6 + (3 if base == "float" else 0)
    _check(_fwd_grad(fn("grouped"), z, ids, wts, ws, a, b, ct), _fwd_grad(fn("tiles"), z, ids, wts, ws, a, b, ct),
           TOL["fp32_shallow"], f"{base} grouped vs tiles")


@pytest.mark.parametrize("impl", ["tiles", "grouped"])
def test_shared_a_equals_per_expert_a_tiled(problem, ct, impl):
    """A [in, r] shared by every expert (no expert axis) gives the per-expert path's outputs and gradients with that A
    tiled over E, the shared A's gradient being the sum of the tiled ones (same products: equal to fp32 rounding,
    seen 0); and the float64 reference agrees."""
    z, ids, wts, _, floats, a, b = problem
    shared = tuple(x[0] for x in a)                                   # [in, r]
    tiled = tuple(jnp.broadcast_to(x, (E, *x.shape)) for x in shared)
    fn = partial(experts_lora, impl=impl)
    y_s, (dz_s, da_s, db_s) = _fwd_grad(fn, z, ids, wts, floats, shared, b, ct)
    y_t, (dz_t, da_t, db_t) = _fwd_grad(fn, z, ids, wts, floats, tiled, b, ct)
    assert all(x.shape == s.shape for x, s in zip(da_s, shared, strict=True))
    assert_close(y_s, y_t, TOL["fp32_shallow"], name="shared-A fwd")
    assert_close(dz_s, dz_t, TOL["fp32_shallow"], name="shared-A dz")
    for i in range(3):
        assert_close(da_s[i], da_t[i].sum(0), TOL["fp32_shallow"], name=f"shared-A dA{i}")
        assert_close(db_s[i], db_t[i], TOL["fp32_shallow"], name=f"shared-A dB{i}")
    assert_close(y_s, _reference(z, ids, wts, floats, tiled, b), TOL["fp32_shallow"], name="shared-A vs float64")
