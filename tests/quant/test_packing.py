"""k3jax.quant: compressed-tensors packing, expert-stack layout, lossless export of QAT weights
(docs/numerics.md §10.3, §10.7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import quant
from k3jax.ops import mx
from k3jax.reference import mx as ref


def _w(shape, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, size=shape[:-1] + (1,)))).astype(dtype)


def test_pack_matches_oracle_bytes_and_nibble_order():
    w = _w((5, 96), 1)
    w[0, 1] = -1e-6  # odd column, tiny negative: high nibble 0x8
    w[0, 2] = -0.0  # exact -0.0: code 0x0, as compressed-tensors writes it (docs/numerics.md §10.2)
    w[1, 32:64] = -0.0  # an all--0.0 block: scale byte 0, every code 0x0
    packed, scale = quant.mxfp4_pack(jnp.asarray(w))
    codes, want_scale = ref.quantize(w, "e2m1", "even")
    want_packed = np.array([ref.pack_row(r) for r in codes], dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(packed), want_packed)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    assert packed.shape == (5, 48) and scale.shape == (5, 3)
    assert np.asarray(packed)[0, 0] >> 4 == 8 and np.asarray(packed)[0, 0] & 0xF == codes[0, 0]
    assert np.asarray(packed)[0, 1] & 0xF == 0 and codes[0, 2] == 0
    assert (np.asarray(packed)[1, 16:32] == 0).all() and np.asarray(scale)[1, 1] == 0


def test_unpack_matches_float4_bitcast():
    # docs/numerics.md §10.3: bitcast u8 -> float4_e2m1fn gives [..., m, 2] with the low nibble first.
    packed = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
    scale = jnp.full((16, 1), 127, jnp.uint8)
    f4 = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn).astype(jnp.float32).reshape(16, 32)
    np.testing.assert_array_equal(np.asarray(quant.mxfp4_unpack(packed, scale)), np.asarray(f4))


@pytest.mark.parametrize("rule", ["floor", "even", "ceil"])
def test_pack_unpack_round_trip(rule):
    rng = np.random.default_rng(3)
    packed = jnp.asarray(rng.integers(0, 256, (4, 3, 64), dtype=np.uint8))
    scale = jnp.asarray(rng.integers(100, 150, (4, 3, 4), dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(mx.pack_codes(mx.unpack_codes(packed))), np.asarray(packed))
    w = quant.mxfp4_unpack(packed, scale)
    p2, s2 = quant.mxfp4_pack(w, rule=rule)
    np.testing.assert_array_equal(np.asarray(quant.mxfp4_unpack(p2, s2)), np.asarray(w))  # value-exact


def test_mxfp8_pack_round_trip():
    x = jnp.asarray(_w((3, 64), 4))
    data, scale = quant.mxfp8_pack(x)
    assert data.dtype == jnp.uint8 and data.shape == (3, 64) and scale.shape == (3, 2)
    d = quant.mxfp8_unpack(data, scale)
    np.testing.assert_array_equal(np.asarray(d), np.asarray(quant.fake_quant_mxfp8(x)))
    d2 = quant.mxfp8_unpack(*quant.mxfp8_pack(d))
    np.testing.assert_array_equal(np.asarray(d2), np.asarray(d))


def test_bad_inputs_name_tensor_and_shapes():
    with pytest.raises(ValueError, match=r"w: last axis .* shape \(2, 48\)"):
        quant.mxfp4_pack(jnp.ones((2, 48)))
    with pytest.raises(ValueError, match="w must be a float"):
        quant.mxfp4_pack(jnp.ones((2, 32), jnp.int32))
    with pytest.raises(ValueError, match="weight_packed must be uint8"):
        quant.mxfp4_unpack(jnp.ones((2, 16), jnp.int8), jnp.ones((2, 1), jnp.uint8))
    with pytest.raises(ValueError, match="weight_scale must be uint8"):
        quant.mxfp4_unpack(jnp.ones((2, 16), jnp.uint8), jnp.ones((2, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"packed shape \(2, 16\) and scale shape \(2, 2\)"):
        quant.mxfp4_unpack(jnp.ones((2, 16), jnp.uint8), jnp.ones((2, 2), jnp.uint8))
    with pytest.raises(ValueError, match=r"w2: in = 24 .*\(4, 24, 32\)"):
        quant.pack_experts(jnp.ones((4, 24, 32)), name="w2")
    with pytest.raises(ValueError, match="w1: packed shape"):
        quant.unpack_experts(jnp.ones((2, 8, 16), jnp.uint8), jnp.ones((2, 8, 2), jnp.uint8), name="w1")


def test_expert_stack_layout():
    E, P, F = 3, 64, 32
    w1 = jnp.asarray(_w((E, P, F), 5))
    packed, scale = quant.pack_experts(w1)
    assert packed.shape == (E, F, P // 2) and scale.shape == (E, F, P // 32)  # torch [out, in/2] per expert
    back = quant.unpack_experts(packed, scale)
    assert back.shape == (E, P, F)
    # expert e, torch row r (= output column r) is the MXFP4 quantization of w1[e, :, r] in blocks along `in`
    p_er, s_er = quant.mxfp4_pack(w1[1, :, 7])
    np.testing.assert_array_equal(np.asarray(packed[1, 7]), np.asarray(p_er))
    np.testing.assert_array_equal(np.asarray(scale[1, 7]), np.asarray(s_er))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(quant.fake_quant_mxfp4(w1, axis=1)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_export_of_qat_weights_is_lossless(dtype):
    E, P, F = 4, 64, 96
    experts = {"w1": jnp.asarray(_w((E, P, F), 6), dtype), "w3": jnp.asarray(_w((E, P, F), 7), dtype),
               "w2": jnp.asarray(_w((E, F, P), 8), dtype)}
    packed, scale = quant.pack_experts(experts["w2"], name="w2")
    assert packed.shape == (E, P, F // 2) and scale.shape == (E, P, F // 32)
    for key, w in experts.items():
        back = quant.unpack_experts(*quant.pack_experts(w, name=key), dtype=dtype, name=key)
        fq = mx.fake_quant_mxfp4(w, axis=1, rule="even")  # what the MoE layer computes with under qat="weights"
        assert fq.dtype == dtype
        np.testing.assert_array_equal(np.asarray(back).view(np.uint16 if dtype == jnp.bfloat16 else np.uint32),
                                      np.asarray(fq).view(np.uint16 if dtype == jnp.bfloat16 else np.uint32))

