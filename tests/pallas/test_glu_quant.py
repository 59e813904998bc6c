"""The fused GLU + MXFP8 kernel (pallas_kernels/glu_quant): the TPU schedule in the Pallas interpreter gives the
unfused XLA form's h bit for bit (act in fp32, h rounded to the rows' dtype, E4M3 qdq of blocks of 32) and its
gradients, on partial row tiles, leading axes and inside ``shard_map``; a NaN or Inf makes its whole block NaN; and
each expert FFN that runs the GLU hidden (``ops.activations.glu_hidden``) gives the same values and gradients with
the fused quant as without it. Its Mosaic compile is in tests/pallas/test_targets.py."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as Pspec

from k3jax.ops import grouped_matmul as gm
from k3jax.ops import mx
from k3jax.ops.activations import glu_activation, glu_hidden
from k3jax.ops.packed_experts import PackedWeight, experts_packed
from k3jax.quant import mxfp4_pack
from pallas_kernels.glu_quant import glu_mxfp8
from pallas_kernels.glu_quant.api import block_sizes
from pallas_kernels.glu_quant.reference import glu_mxfp8_reference
from pallas_kernels.mxfp4_matmul import mxfp4_glu_ffn

ACT = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
FUSED = mx.ActQuant(rule="ceil", glu=partial(glu_mxfp8, interpret=True))
UNFUSED = mx.ActQuant(rule="ceil")


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype == jnp.bfloat16 else np.uint32)


def _inputs(shape, dtype, seed=0, scale=3.0):
    ka, kb = jax.random.split(jax.random.key(seed))
    return (scale * jax.random.normal(ka, shape)).astype(dtype), (scale * jax.random.normal(kb, shape)).astype(dtype)


@pytest.mark.parametrize("shape,in_dt,out_dt,rule", [
    ((300, 1536), jnp.float32, jnp.bfloat16, "ceil"),   # a partial last row tile, 3 column tiles of 512
    ((77, 96), jnp.bfloat16, jnp.bfloat16, "even"),      # fewer rows than a tile; F not a multiple of 128: one tile
    ((2, 5, 256), jnp.float32, jnp.float32, "floor"),    # leading axes (the dense experts' [M, E, F])
])
def test_kernel_equals_unfused_bit_for_bit(shape, in_dt, out_dt, rule):
    a, b = _inputs(shape, in_dt)
    a = a.at[..., :32].multiply(1e-30)  # a block of tiny values: subnormal scales and results
    got = glu_mxfp8(a, b, ACT, out_dt, rule, interpret=True)
    want = glu_mxfp8_reference(a, b, ACT, out_dt, rule)
    assert got.dtype == out_dt and got.shape == shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_block_sizes():
    assert block_sizes(81920, 3072) == (256, 1024)
    assert block_sizes(40, 1536) == (40, 512)
    assert block_sizes(300, 96) == (256, 96)


def test_nan_poisons_its_block_only():
    a, b = _inputs((16, 128), jnp.float32)
    a, b = a.at[3, 5].set(jnp.nan), b.at[9, 70].set(jnp.nan)  # SiTU-GLU is bounded: an Inf input gives a finite h
    h = np.asarray(glu_mxfp8(a, b, ACT, jnp.float32, interpret=True))
    poisoned = np.zeros(h.shape, bool)
    poisoned[3, 0:32] = poisoned[9, 64:96] = True
    assert np.isnan(h[poisoned]).all() and np.isfinite(h[~poisoned]).all()


def test_gradient_is_the_unfused_straight_through_one():
    a, b = _inputs((40, 256), jnp.float32)
    ct = jax.random.normal(jax.random.key(1), (40, 256))

    def grads(fn):
        return jax.grad(lambda a, b: jnp.vdot(fn(a, b, ACT, jnp.bfloat16, "ceil").astype(jnp.float32), ct),
                        (0, 1))(a, b)

    for g, w in zip(grads(partial(glu_mxfp8, interpret=True)), grads(glu_mxfp8_reference), strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)


def test_kernel_inside_shard_map():
    """Rows split over 4 devices: the kernel's output declares the inputs' varying axes (the TPU interpreter)."""
    mesh = jax.make_mesh((4,), ("x",))
    a, b = jax.device_put(_inputs((64, 128), jnp.float32), jax.NamedSharding(mesh, Pspec("x")))
    f = jax.shard_map(lambda a, b: glu_mxfp8(a, b, ACT, jnp.bfloat16, interpret=True), mesh=mesh,
                      in_specs=(Pspec("x"), Pspec("x")), out_specs=Pspec("x"))
    np.testing.assert_array_equal(_bits(jax.jit(f)(a, b)), _bits(glu_mxfp8_reference(a, b, ACT, jnp.bfloat16)))


def test_glu_hidden_without_quant_and_refusals():
    a, b = _inputs((8, 64), jnp.float32)
    np.testing.assert_array_equal(np.asarray(glu_hidden(a, b, ACT, jnp.bfloat16)),
                                  np.asarray(ACT(a, b).astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="multiple of 32"):
        glu_mxfp8(a[:, :40], b[:, :40], ACT, jnp.bfloat16, interpret=True)
    assert FUSED(a).dtype == a.dtype  # called on an array, an ActQuant is the plain fake-quant
    np.testing.assert_array_equal(np.asarray(FUSED(a)), np.asarray(mx.fake_quant_mxfp8(a, axis=-1)))


# ------------------------------------------------------------------------------------------------ the expert FFNs

E, P, F, M, A = 3, 128, 256, 24, 2


@pytest.fixture(scope="module")
def problem():
    k = jax.random.split(jax.random.key(7), 6)
    z = jax.random.normal(k[0], (M, P)).astype(jnp.bfloat16)
    ids = jax.random.randint(k[1], (M, A), 0, E)
    wts = jax.nn.softmax(jax.random.normal(k[2], (M, A)), -1)
    w = [0.1 * jax.random.normal(k[3 + i], s) for i, s in enumerate(((E, P, F), (E, P, F), (E, F, P)))]
    return z, ids, wts, w


# default pass: the QAT experts on TPU (ragged), on CPU (tiled), the frozen experts' FFN kernel; the rest slow
@pytest.mark.parametrize("path", ["ragged", "tiled", "packed_kernel", pytest.param("dense", marks=pytest.mark.slow),
                                  pytest.param("packed_tiles", marks=pytest.mark.slow)])
def test_expert_ffns_fused_equal_unfused(problem, path):
    z, ids, wts, w = problem
    if path == "dense":
        z = z.astype(jnp.float32)  # XLA:CPU has no bf16 x bf16 -> f32 batched dot
    if path.startswith("packed"):
        w = [PackedWeight(*mxfp4_pack(jnp.swapaxes(x, 1, 2))) for x in w]  # torch orientation [E, out, in]
        fn = partial(experts_packed, impl="tiles") if path == "packed_tiles" else partial(
            experts_packed, impl="gmm", gmm=partial(mxfp4_glu_ffn, block_m=16, platform="tpu", interpret=True))
    else:
        fn = {"ragged": gm.experts_ragged, "tiled": gm.experts_tiled, "dense": gm.experts_dense}[path]

    def run(aq):
        return jax.value_and_grad(lambda z: jnp.sum(fn(z, ids, wts, *w, ACT, act_quant=aq) ** 2))(z)

    (v, g), (v_ref, g_ref) = run(FUSED), run(UNFUSED)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(v_ref))
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g_ref, np.float32))


def test_moe_act_quant_runs_the_kernel_only_for_a_tpu_target():
    """The MoE layer's quant carries the kernel (k3jax/layers/backends.py), which answers None off TPU: glu_hidden then
    runs the unfused form (the CPU suite's QAT runs never import Pallas for it)."""
    from k3jax.layers import backends

    a, b = _inputs((8, 64), jnp.float32)
    aq = backends.act_quant_mxfp8("ceil")
    assert aq.glu(a, b, ACT, jnp.bfloat16, "ceil") is None
    np.testing.assert_array_equal(_bits(glu_hidden(a, b, ACT, jnp.bfloat16, act_quant=aq)),
                                  _bits(glu_mxfp8_reference(a, b, ACT, jnp.bfloat16)))
