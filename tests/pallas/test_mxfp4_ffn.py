"""The grouped GLU FFN in tile space (pallas_kernels/mxfp4_matmul/ffn.py): the same values and rows' gradient as the
three ``mxfp4_gmm`` calls it replaces (bit for bit: the same kernels on the same tiles, the same roundings), with
the MXFP8 fake-quant of h and without, in fp32 and bf16, on the loop schedule and on the TPU schedule in the TPU
interpreter; against float64 NumPy; and its input checks."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import mx
from k3jax.ops.activations import glu_activation
from k3jax.quant import mxfp4_pack
from k3jax.testing import TOL, assert_close
from pallas_kernels.mxfp4_matmul import mxfp4_glu_ffn, mxfp4_gmm
from pallas_kernels.mxfp4_matmul.reference import dequantize_packed

ACT = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
G, P, F, M = 3, 256, 512, 40
GS = np.array([5, 0, 23])  # an empty expert; 12 rows past the groups


def _problem(dtype):
    k = jax.random.split(jax.random.key(3), 5)
    w = [mxfp4_pack(0.05 * jax.random.normal(k[i], s)) for i, s in zip((0, 1, 2), ((G, F, P), (G, F, P), (G, P, F)),
                                                                       strict=True)]
    x = jax.random.normal(k[3], (M, P)).astype(dtype)
    ct = jax.random.normal(k[4], (M, P))
    return x, w, ct


def _three_calls(x, w, gs, act_quant, **kw):
    (p1, s1), (p3, s3), (p2, s2) = w
    a = mxfp4_gmm(x, p1, s1, gs, **kw).astype(jnp.float32)
    b = mxfp4_gmm(x, p3, s3, gs, **kw).astype(jnp.float32)
    h = ACT(a, b).astype(x.dtype)
    if act_quant is not None:
        h = act_quant(h)
    return mxfp4_gmm(h, p2, s2, gs, **kw)


@pytest.mark.parametrize("platform", ["cpu", "tpu"], ids=["loop", "tpu"])
@pytest.mark.parametrize("dtype,quant", [(jnp.float32, False), (jnp.bfloat16, True)], ids=["f32", "bf16-mxfp8"])
def test_ffn_equals_three_grouped_matmuls(platform, dtype, quant):
    x, w, ct = _problem(dtype)
    gs = jnp.asarray(GS, jnp.int32)
    aq = partial(mx.fake_quant_mxfp8, axis=-1) if quant else None
    kw = {"block_m": 16, "block_n": 128, "block_k": 256, "platform": platform, "interpret": True}

    def vjp(fn):
        y, back = jax.vjp(fn, x)
        return y, back(ct.astype(y.dtype))[0]

    y, dx = vjp(lambda x: mxfp4_glu_ffn(x, *w, gs, ACT, act_quant=aq, **kw))
    y_ref, dx_ref = vjp(lambda x: _three_calls(x, w, gs, aq, **kw))
    assert y.dtype == dx.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(y, np.float32)[GS.sum():], 0.0)  # rows past the groups
    np.testing.assert_array_equal(np.asarray(dx, np.float32)[GS.sum():], 0.0)


# CI's budget: one case per schedule in the default pass (the loop schedule in bf16, the TPU one in f32)
@pytest.mark.parametrize("platform,dtype", [("cpu", jnp.bfloat16), ("tpu", jnp.float32),
                                            pytest.param("cpu", jnp.float32, marks=pytest.mark.slow),
                                            pytest.param("tpu", jnp.bfloat16, marks=pytest.mark.slow)],
                         ids=["loop-bf16", "tpu-f32", "loop-f32", "tpu-bf16"])
def test_gather_form_equals_the_sorted_rows(platform, dtype):
    """The gather form (``rows=(order, inverse)``, ``copies``): a table of N = 10 tokens with 4 copies each, sorted by
    expert (some copies past the groups), against the sorted form on x[order // copies] with the output un-permuted:
    y bit for bit; the table's gradient against the sorted form's rows' gradients summed per token (the copies'
    sum in fp32, rounded once: bit for bit in fp32, within rounding in bf16)."""
    _, w, _ = _problem(dtype)
    k = jax.random.split(jax.random.key(4), 3)
    N, A = 10, 4
    x = jax.random.normal(k[0], (N, P)).astype(dtype)
    ids = jax.random.randint(k[1], (N * A,), 0, G + 1)                   # id G: a copy past the groups
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(N * A, dtype=jnp.int32))
    gs = jnp.bincount(ids, length=G).astype(jnp.int32)
    ct = jax.random.normal(k[2], (N * A, P))
    kw = {"block_m": 16, "block_n": 128, "block_k": 256, "platform": platform, "interpret": True}

    def vjp(fn):
        y, back = jax.vjp(fn, x)
        return y, back(ct.astype(y.dtype))[0]

    y, dx = vjp(lambda x: mxfp4_glu_ffn(x, *w, gs, ACT, rows=(order, inverse), copies=A, **kw))
    y_ref, dx_ref = vjp(lambda x: mxfp4_glu_ffn(x[order // A], *w, gs, ACT, **kw)[inverse])
    assert y.shape == (N * A, P) and dx.shape == x.shape and y.dtype == dx.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(y, np.float32)[np.asarray(ids) == G], 0.0)
    assert_close(dx, dx_ref, 0.0 if dtype == jnp.float32 else TOL["bf16"], name="table gradient")
    with pytest.raises(ValueError, match="N·copies"):
        mxfp4_glu_ffn(x, *w, gs, ACT, rows=(order[:-1], inverse), copies=A, **kw)


def test_ffn_matches_float64(x64):
    """fp32, the TPU schedule in the interpreter, against the FFN of the exactly decoded stacks in float64."""
    x, w, ct = _problem(jnp.float32)
    y = mxfp4_glu_ffn(x, *w, jnp.asarray(GS, jnp.int32), ACT, block_m=16, block_n=128, block_k=256,
                      platform="tpu", interpret=True)
    w64 = [np.asarray(dequantize_packed(*p), np.float64) for p in w]  # [G, N, K], exact
    xd = np.asarray(x, np.float64)
    want = np.zeros((M, P))
    for g, (lo, hi) in enumerate(zip(np.cumsum(GS) - GS, np.cumsum(GS), strict=True)):
        a, b = xd[lo:hi] @ w64[0][g].T, xd[lo:hi] @ w64[1][g].T
        h = np.asarray(ACT(jnp.asarray(a), jnp.asarray(b)))
        assert h.dtype == np.float64
        want[lo:hi] = h @ w64[2][g].T
    assert_close(y, want, TOL["fp32_vs_fp64"], name="ffn vs float64")


def test_ffn_input_checks():
    x, w, _ = _problem(jnp.float32)
    gs = jnp.asarray(GS, jnp.int32)
    with pytest.raises(ValueError, match="not one GLU FFN"):
        mxfp4_glu_ffn(x, w[0], w[0], w[0], gs, ACT, interpret=True)
    with pytest.raises(ValueError, match=r"group_sizes \(2,\)"):
        mxfp4_glu_ffn(x, *w, gs[:2], ACT, interpret=True)
    with pytest.raises(ValueError, match="do not match x"):
        mxfp4_glu_ffn(x[:, :64], *w, gs, ACT, interpret=True)


@pytest.mark.parametrize("platform", ["cpu", "tpu"], ids=["loop", "tpu"])
def test_stacked_layer_is_read_in_place(platform, monkeypatch):
    """Weights given as stacks of two layers [2, G, ...] with a traced layer index: the same bits, forward and the
    rows' gradient, as the call on that layer's slice; the TPU grid is chosen for one layer's G experts (rows enough
    for the static grid at G = 3, not at 2·G)."""
    import pallas_kernels.mxfp4_matmul.kernel as kmod
    import pallas_kernels.mxfp4_matmul.kernel_t as ktmod

    x, w, ct = _problem(jnp.float32)
    x, ct = jnp.concatenate([x] * 5), jnp.concatenate([ct] * 5)       # 200 rows: 13 + 3 + 1 tiles of 16
    gs = jnp.asarray([25, 0, 150], jnp.int32)
    other = [(jnp.flip(p, 0), jnp.flip(s, 0)) for p, s in w]          # layer 0: the experts in another order
    stacks = [(jnp.stack([o[0], p]), jnp.stack([o[1], s])) for o, (p, s) in zip(other, w, strict=True)]
    seen = []
    for mod in (kmod, ktmod):
        grid = mod.tpu_grid
        monkeypatch.setattr(mod, "tpu_grid", lambda tg, groups, *a, grid=grid: seen.append(groups) or grid(tg, groups,
                                                                                                            *a))
    kw = {"block_m": 16, "block_n": 128, "block_k": 256, "platform": platform, "interpret": True}

    def vjp(fn, *args):
        y, back = jax.vjp(fn, x, *args)
        return y, back(ct)[0]

    y, dx = jax.jit(lambda layer: vjp(lambda x: mxfp4_glu_ffn(x, *[(*s, layer) for s in stacks], gs, ACT, **kw)))(
        jnp.int32(1))
    y_ref, dx_ref = jax.jit(lambda: vjp(lambda x: mxfp4_glu_ffn(x, *w, gs, ACT, **kw)))()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_ref))
    assert set(seen) == ({G} if platform == "tpu" else set())
    with pytest.raises(ValueError, match="all be stacks"):
        mxfp4_glu_ffn(x, (*stacks[0], jnp.int32(0)), *w[1:], gs, ACT, **kw)


def test_stacked_layer_with_an_unaligned_minor_dim_is_sliced(monkeypatch):
    """w2's packed minor dim F/2 = 192 (not a multiple of 128 lanes: stored in another layout than the kernel's) is
    sliced per layer while w1 / w3 (P/2 = 128) are read in place: each kernel gets its own tile groups, and the FFN
    gives the bits of the call on the layer's slices (the TPU schedule, interpreted)."""
    import pallas_kernels.mxfp4_matmul.api as kapi

    k = jax.random.split(jax.random.key(5), 4)
    f2 = 384
    w = [mxfp4_pack(0.05 * jax.random.normal(k[i], s)) for i, s in zip((0, 1, 2), ((G, f2, P), (G, f2, P), (G, P, f2)),
                                                                       strict=True)]
    x = jax.random.normal(k[3], (M, P))
    gs = jnp.asarray(GS, jnp.int32)
    stacks = [(jnp.stack([jnp.flip(p, 0), p]), jnp.stack([jnp.flip(s, 0), s])) for p, s in w]
    got = []
    layer_groups = kapi.layer_groups
    monkeypatch.setattr(kapi, "layer_groups", lambda tg, p, s, layer: got.append(
        (p.shape[-1], (out := layer_groups(tg, p, s, layer))[1].ndim, out[1].shape[0], out[2].shape[0])) or out)
    kw = {"block_m": 16, "block_n": 128, "platform": "tpu", "interpret": True}   # w2's block_k: its whole K = 384
    y = jax.jit(lambda layer: mxfp4_glu_ffn(x, *[(*s, layer) for s in stacks], gs, ACT, **kw))(jnp.int32(1))
    y_ref = jax.jit(lambda: mxfp4_glu_ffn(x, *w, gs, ACT, **kw))()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    # w1, w3 flattened [2G, ·], their scales a layer's slice [G, ·]; w2 and its scales slices
    assert got[:3] == [(128, 3, 2 * G, G), (128, 3, 2 * G, G), (192, 3, G, G)], got
