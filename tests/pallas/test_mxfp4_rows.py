"""The small-batch routed FFN in one kernel (pallas_kernels/mxfp4_matmul/rows.py), in the TPU interpreter: against
its jnp rung and against the grouped gather-form FFN combined as ``experts_grouped`` combines it (values within
fp32 summation order; gradients with respect to the rows and the gates), over stacks read in place, with rows past
the bf16 tile, experts over several chunks of rows, unselected experts and slots routed elsewhere; its selection and
cost estimate; its input checks."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import mx
from k3jax.ops.activations import glu_activation
from k3jax.ops.grouped_matmul import sort_by_expert
from k3jax.quant import mxfp4_pack
from k3jax.testing import TOL, assert_close
from pallas_kernels.mxfp4_matmul import mxfp4_glu_ffn, rows
from pallas_kernels.mxfp4_matmul.cost import idle_probability, rows_ffn_cost
from pallas_kernels.mxfp4_matmul.reference import glu_ffn_rows_reference
from pallas_kernels.mxfp4_matmul.rows import f_block, mxfp4_glu_ffn_rows, selection

ACT = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
G, P, F, N, A = 4, 256, 512, 40, 3   # 40 rows: padded to 48; experts 0 and 2 take 20 rows (two chunks)


def _problem(dtype, layers=None):
    k = jax.random.split(jax.random.key(7), 6)
    lead = () if layers is None else (layers,)
    w = [mxfp4_pack(0.05 * jax.random.normal(k[i], (*lead, *s)))
         for i, s in zip((0, 1, 2), ((G, F, P), (G, F, P), (G, P, F)), strict=True)]
    x = jax.random.normal(k[3], (N, P)).astype(dtype)
    ids = jax.random.randint(k[4], (N, A), 0, G + 1).at[:, 0].set(jnp.array([0, 2] * (N // 2)))  # expert 1, 3: few
    ids = jnp.where(ids == 1, G, ids)            # expert 1 never selected; id G: a slot routed elsewhere
    wts = jax.nn.softmax(jax.random.normal(k[5], (N, A)), axis=-1)
    return x, ids.astype(jnp.int32), wts, w


def _grouped(x, ids, wts, w, rule, **kw):
    order, inverse, gs = sort_by_expert(ids, G)
    aq = None if rule is None else partial(mx.fake_quant_mxfp8, axis=-1, rule=rule)
    y = mxfp4_glu_ffn(x, *w, gs, ACT, act_quant=aq, platform="tpu", interpret=True, rows=(order, inverse), copies=A,
                      **kw)
    return jnp.einsum("nap,na->np", y.astype(jnp.float32).reshape(N, A, -1), wts)


# CI's budget: the decode case (bf16 rows, h MXFP8) in the default pass, fp32 without the quant in the slow one
@pytest.mark.parametrize("dtype,rule", [pytest.param(jnp.float32, None, marks=pytest.mark.slow),
                                        (jnp.bfloat16, "ceil")], ids=["f32", "bf16-mxfp8"])
def test_rows_ffn_equals_the_grouped_ffn_and_its_reference(dtype, rule):
    x, ids, wts, w = _problem(dtype)
    ct = jax.random.normal(jax.random.key(1), (N, P))
    fused = partial(mxfp4_glu_ffn_rows, act_quant_rule=rule, block_f=256, interpret=True)
    y, back = jax.vjp(lambda x, g: fused(x, ids, g, *w, ACT), x, wts)
    y_g, back_g = jax.vjp(lambda x, g: _grouped(x, ids, g, w, rule), x, wts)
    y_ref = glu_ffn_rows_reference(x, ids, wts, *w, ACT, rule)
    assert y.dtype == jnp.float32 and y.shape == (N, P)
    # fp32 output, the same roundings to the rows' dtype: only the fp32 summation order differs (bf16: 4e-8 seen)
    assert_close(y, y_g, TOL["fp32_shallow"], name="y vs grouped")
    assert_close(y, y_ref, TOL["fp32_shallow"], name="y vs reference")
    for a, b in zip(back(ct), back_g(ct), strict=True):     # the VJP is the grouped form's
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("vmem", [0, 1 << 30], ids=["scales-in-place", "scales-sliced"])
def test_rows_ffn_reads_a_stacked_layer_in_place(monkeypatch, vmem):
    """A layer of stacks: the packed bytes in place; the scales in place where the stack exceeds the chip's VMEM
    (here: a VMEM of 0 bytes), else sliced."""
    monkeypatch.setattr(rows, "tpu_vmem_bytes", lambda: vmem)
    x, ids, wts, w = _problem(jnp.float32, layers=3)
    layer = jnp.int32(2)
    y = mxfp4_glu_ffn_rows(x, ids, wts, *((*wi, layer) for wi in w), ACT, interpret=True)
    one = [tuple(a[2] for a in wi) for wi in w]
    assert_close(y, glu_ffn_rows_reference(x, ids, wts, *one, ACT), TOL["fp32_shallow"])


def test_selection_and_the_charged_experts():
    ids = jnp.array([[0, 4], [2, 0], [4, 4]], jnp.int32)
    wts = jnp.array([[0.5, 0.25], [0.75, 1.0], [1.0, 1.0]])
    sel, count, n_rows, rank, gates = selection(ids, wts, 4)
    np.testing.assert_array_equal(sel, [0, 2, -1, -1])
    assert int(count[0]) == 2
    np.testing.assert_array_equal(n_rows, [2, 0, 1, 0])
    np.testing.assert_array_equal(rank[..., 0], [[0, 1, -1], [-1, -1, -1], [-1, 0, -1], [-1, -1, -1]])
    np.testing.assert_allclose(gates[..., 0], [[0.5, 1.0, 0.0], [0, 0, 0], [0, 0.75, 0], [0, 0, 0]])
    # P(no local expert) for 1 token, top-2 of 8 with 2 local: C(6, 2) / C(8, 2) = 15/28
    assert idle_probability(1, 2, 8, 2) == pytest.approx(15 / 28)
    assert idle_probability(3, 2, 8, 7) == 0.0
    # 2.5 experts' three weights (F·(P/2 + P/32) bytes each), 16 ranks and gates; 16 rows read (bf16) and written
    # (fp32); 3 chunks of 16 rows: three matmuls, gathers in 2 F blocks and one combine, 2·16·256 FLOPs per row each
    c = rows_ffn_cost(16, 256, 512, 2, 2.5, 3, 16, 2)
    assert c == {"flops": 3 * 16 * (6 * 512 * 256 + 2 * 16 * 256 * 3),
                 "bytes_accessed": int(2.5 * (3 * 512 * (128 + 8) + 128) + 16 * 256 * 6)}
    assert f_block(3072) == 512 and f_block(768) == 256 and f_block(384) == 384 and f_block(96) == 96
    with pytest.raises(ValueError, match="block_f"):
        f_block(768, 128)


def test_rows_ffn_input_checks():
    x, ids, wts, w = _problem(jnp.float32)
    with pytest.raises(ValueError, match=r"ids .* and weights"):
        mxfp4_glu_ffn_rows(x, ids[:, :2], wts, *w, ACT, interpret=True)
    with pytest.raises(ValueError, match="not one GLU FFN"):
        mxfp4_glu_ffn_rows(x, ids, wts, w[0], tuple(a[:, :256] for a in w[1]), w[2], ACT, interpret=True)
    with pytest.raises(ValueError, match="one layer index"):
        mxfp4_glu_ffn_rows(x, ids, wts, (*w[0], jnp.int32(0)), *w[1:], ACT, interpret=True)
