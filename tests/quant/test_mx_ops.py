"""k3jax.ops.mx against the scalar float64 oracle k3jax.reference.mx (docs/numerics.md §10, §15.2: bit-exact /
byte-exact)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from k3jax.ops import mx
from k3jax.reference import mx as ref

RULES = ("floor", "even", "ceil")
quantize4 = jax.jit(mx.mxfp4_quantize, static_argnames=("axis", "rule"))
quantize8 = jax.jit(mx.mxfp8_quantize, static_argnames=("axis", "rule", "fmt"))


def _f8_bytes(e):
    return np.asarray(jax.lax.bitcast_convert_type(e, jnp.uint8))


def _mixed(seed, rows=6, n=64):
    """Rows with wildly different magnitudes, exact ties, -0 and zero blocks."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)) * np.exp2(rng.integers(-120, 120, size=(rows, 1)))
    x[0, :32] = 0.0
    x[0, 32:] = -0.0
    x[1, :8] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0**-3  # ties at the 'even' scale of 6/8
    x[1, 8:16] = -x[1, :8]
    x[2, 3] = -1e-3 * abs(x[2]).max()  # a tiny negative: code 0x8
    x[2, 4] = -0.0  # an exact -0.0 in a non-zero block: code 0x0 (compressed-tensors)
    x[2, 5] = -1e-40  # a negative float32 subnormal: counts as zero, but is negative -> 0x8
    x = x.astype(np.float32)
    x[2, 5] = -np.float32(1e-40)
    return x


def test_every_e2m1_code_decodes():
    codes = jnp.arange(16, dtype=jnp.uint8)
    got = np.asarray(mx.e2m1_decode(codes))
    np.testing.assert_array_equal(got.view(np.uint32), mx.E2M1_VALUES.view(np.uint32))  # -0 included
    assert [ref.element_value(c, "e2m1") for c in range(16)] == list(mx.E2M1_VALUES)


def test_every_e8m0_byte():
    b = jnp.arange(256, dtype=jnp.uint8)
    got = np.asarray(mx.e8m0_to_float(b))
    want = np.array([ref.e8m0_value(i) for i in range(256)], dtype=np.float32)
    np.testing.assert_array_equal(got[:255].view(np.uint32), want[:255].view(np.uint32))
    assert got[0] == np.float32(2.0**-127) and np.isnan(got[255])
    got16 = np.asarray(mx.e8m0_to_float(b, jnp.bfloat16)).astype(np.float64)
    np.testing.assert_array_equal(got16[:255], want[:255].astype(np.float64))


def test_host_tables_match_the_bit_decoders():
    """The numpy byte tables (host decoder) against the jnp decoders, for every byte; nibble packing inverts."""
    b = jnp.arange(256, dtype=jnp.uint8)
    np.testing.assert_array_equal(mx.E8M0_VALUES[:255].view(np.uint32),
                                  np.asarray(mx.e8m0_to_float(b))[:255].view(np.uint32))
    assert np.isnan(mx.E8M0_VALUES[255])
    codes = mx.unpack_codes(b[:, None])  # [256, 2]: low nibble (even column), high nibble (odd column)
    np.testing.assert_array_equal(mx.E2M1_BYTE_PAIR.view(np.uint32), np.asarray(mx.e2m1_decode(codes)).view(np.uint32))
    np.testing.assert_array_equal(mx.E2M1_BYTE_LO, mx.E2M1_BYTE_PAIR[:, 0])
    np.testing.assert_array_equal(mx.E2M1_BYTE_HI, mx.E2M1_BYTE_PAIR[:, 1])
    np.testing.assert_array_equal(np.asarray(mx.pack_codes(codes))[:, 0], np.asarray(b))
    assert not mx.E8M0_VALUES.flags.writeable and not mx.E2M1_BYTE_PAIR.flags.writeable


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("rule", RULES)
def test_scale_byte_matches_oracle_for_every_exponent(fmt, rule):
    sig = np.array([1.0, 1.25, 1.5, 1.7499999, 1.75, 1.9999999, 1.0000001])
    amax = (sig[None, :] * np.exp2(np.arange(-126, 128))[:, None]).astype(np.float32).ravel()
    amax = np.concatenate([amax, np.float32([0, 1e-40, 3e-39, np.inf, np.nan, 6, 7, 448, 449])])
    got = np.asarray(jax.jit(mx.scale_bytes, static_argnames=("fmt", "rule"))(jnp.asarray(amax), fmt=fmt, rule=rule))
    flushed = [0.0 if (abs(a) < ref.F32_MIN_NORMAL) else float(a) for a in amax]
    want = np.array([ref.scale_byte(a, fmt, rule) for a in flushed])
    np.testing.assert_array_equal(got, want)


def test_even_rule_worked_examples():
    a = jnp.float32([1.0, 1.5, 1.74, 1.75, 6.0, 7.0, 0.0])
    np.testing.assert_array_equal(np.asarray(mx.scale_bytes(a, rule="even")), [125, 125, 125, 126, 127, 128, 0])


def test_ties_to_even_and_negative_zero():
    v = jnp.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.1, -0.0, 0.0, -7.0, np.inf])
    got = np.asarray(mx.e2m1_round_codes(v))
    np.testing.assert_array_equal(got, [0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 0, 0, 15, 7])  # -0.0 -> 0x0, -0.1 -> 0x8


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp4_quantize_byte_exact(rule, seed):
    x = _mixed(seed)
    codes, scale = quantize4(jnp.asarray(x), rule=rule)
    want_codes, want_scale = ref.quantize(x, "e2m1", rule)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    np.testing.assert_array_equal(np.asarray(codes), want_codes)
    # signed zeros as compressed-tensors writes them (docs/numerics.md §10.2): a negative that rounds to 0 -> 0x8 (also
    # a negative subnormal), an exact -0.0 -> 0x0 (also in an all--0.0 block, whose scale byte is 0)
    c = np.asarray(codes)
    assert c[2, 3] == 8 and c[2, 5] == 8 and c[2, 4] == 0
    assert (c[0, 32:] == 0).all() and np.asarray(scale)[0, 1] == 0
    assert (want_codes[2, 3], want_codes[2, 5], want_codes[2, 4]) == (8, 8, 0) and (want_codes[0, 32:] == 0).all()
    deq = np.asarray(mx.mxfp4_dequantize(codes, scale))
    np.testing.assert_array_equal(deq, ref.dequantize(want_codes, want_scale, "e2m1").astype(np.float32))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rule", RULES)
def test_mxfp8_quantize_byte_exact(fmt, rule):
    x = _mixed(3, rows=4)
    elems, scale = quantize8(jnp.asarray(x), rule=rule, fmt=fmt)
    want_codes, want_scale = ref.quantize(x, fmt, rule)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    np.testing.assert_array_equal(_f8_bytes(elems), want_codes)
    deq = np.asarray(mx.mxfp8_dequantize(elems, scale))
    np.testing.assert_array_equal(deq, ref.dequantize(want_codes, want_scale, fmt).astype(np.float32))
    assert np.isfinite(deq).all()  # clipped before the non-saturating cast (floor rule would give 480 -> NaN)


def test_dequantize_every_scale_byte_exact_including_subnormal_results():
    rng = np.random.default_rng(0)
    scale = np.arange(256, dtype=np.uint8).reshape(8, 32)
    codes = rng.integers(0, 16, size=(8, 32 * 32), dtype=np.uint8)
    got = np.asarray(jax.jit(mx.mxfp4_dequantize)(jnp.asarray(codes), jnp.asarray(scale)))
    want = ref.dequantize(codes, scale, "e2m1")
    with np.errstate(over="ignore"):
        want32 = want.astype(np.float32)  # values past float32 (bytes >= 253) are +-Inf in both
    nan = np.isnan(want32)
    assert nan.sum() == 32 and np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want32[~nan].view(np.uint32))
    assert (np.abs(got[~nan][got[~nan] != 0]) < 2.0**-126).any()  # subnormal results were produced exactly


def test_dequantize_float64_and_bfloat16(x64):
    codes = jnp.arange(64, dtype=jnp.uint8).reshape(2, 32) % 16
    scale = jnp.array([[0], [200]], dtype=jnp.uint8)
    want = ref.dequantize(np.asarray(codes), np.asarray(scale), "e2m1")
    np.testing.assert_array_equal(np.asarray(mx.mxfp4_dequantize(codes, scale, dtype=jnp.float64)), want)
    bf = np.asarray(mx.mxfp4_dequantize(codes, scale, dtype=jnp.bfloat16)).astype(np.float64)
    np.testing.assert_array_equal(bf, want)  # fp4 x 2^e is exact in bf16, subnormal included


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("requant_rule", RULES)
def test_requantize_dequantized_is_value_exact(rule, requant_rule):
    x = jnp.asarray(_mixed(7, rows=16, n=128))
    d = mx.mxfp4_dequantize(*quantize4(x, rule=rule))
    d2 = mx.mxfp4_dequantize(*quantize4(d, rule=requant_rule))
    np.testing.assert_array_equal(np.asarray(d2), np.asarray(d))


def test_non_finite_blocks_become_nan_scale():
    x = np.ones((3, 64), np.float32)
    x[0, 5], x[1, 40], x[2, 0] = np.nan, np.inf, -np.inf
    codes, scale = quantize4(jnp.asarray(x), rule="even")
    np.testing.assert_array_equal(np.asarray(scale), [[255, 125], [125, 255], [255, 125]])
    assert (np.asarray(codes)[0, :32] == 0).all()
    d = np.asarray(mx.mxfp4_dequantize(codes, scale))
    assert np.isnan(d[0, :32]).all() and (d[0, 32:] == 1).all() and np.isnan(d[1, 32:]).all()
    assert mx.count_scale_bytes(scale) == {"zero": 0, "nan": 3, "total": 6}
    assert mx.count_scale_bytes(np.zeros(5, np.uint8))["zero"] == 5
    with pytest.raises(ValueError, match="uint8"):
        mx.count_scale_bytes(np.zeros(5, np.int32))


def test_subnormal_inputs_are_signed_zero():
    x = np.zeros((1, 64), np.float32)
    x[0, :32] = 3e-39  # float32 subnormals only
    x[0, 32:] = -1e-40
    for rule in RULES:
        codes, scale = quantize4(jnp.asarray(x), rule=rule)
        np.testing.assert_array_equal(np.asarray(scale), [[0, 0]])
        np.testing.assert_array_equal(np.asarray(codes)[0], [0] * 32 + [8] * 32)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.mxfp4_quantize(jnp.ones((2, 48)))
    with pytest.raises(ValueError, match="scale rule"):
        mx.fake_quant_mxfp4(jnp.ones((2, 32)), axis=1, rule="nearest")


@given(hnp.arrays(np.float32, (2, 64), elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=True)),
       st.sampled_from(RULES))
def test_mxfp4_matches_oracle_hypothesis(x, rule):
    codes, scale = quantize4(jnp.asarray(x), rule=rule)
    want_codes, want_scale = ref.quantize(x, "e2m1", rule)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    np.testing.assert_array_equal(np.asarray(codes), want_codes)


# ----------------------------------------------------------------------------------------------------------------
# STE fake-quant


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fake_quant_mxfp4_forward_and_identity_gradient(dtype):
    w = jnp.asarray(_mixed(11, rows=3, n=64).reshape(3, 64, 1) * np.ones((1, 1, 5), np.float32), dtype)
    fq = jax.jit(lambda w: mx.fake_quant_mxfp4(w, axis=1))
    out = fq(w)
    assert out.shape == w.shape and out.dtype == w.dtype
    codes, scale = mx.mxfp4_quantize(jnp.moveaxis(w, 1, -1).astype(jnp.float32), rule="even")
    want = jnp.moveaxis(mx.mxfp4_dequantize(codes, scale, dtype=dtype), -1, 1)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    c = jax.random.normal(jax.random.key(0), w.shape, dtype)
    g = jax.jit(jax.grad(lambda w: jnp.sum(mx.fake_quant_mxfp4(w, axis=1) * c)))(w)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))


def test_fake_quant_float64(x64):
    w = jnp.asarray(_mixed(12, rows=3), jnp.float64)
    out = mx.fake_quant_mxfp4(w, axis=-1, rule="floor")
    assert out.dtype == jnp.float64
    want = ref.dequantize(*ref.quantize(np.asarray(w), "e2m1", "floor"), "e2m1")
    np.testing.assert_array_equal(np.asarray(out), want)
    g = jax.grad(lambda w: jnp.sum(mx.fake_quant_mxfp8(w, axis=0) ** 2))(w)
    np.testing.assert_array_equal(np.asarray(g), 2 * np.asarray(mx.fake_quant_mxfp8(w, axis=0)))


def test_fake_quant_short_last_block_pads_with_zeros():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 40)).astype(np.float32))
    out = mx.fake_quant_mxfp4(x, axis=-1)
    padded = jnp.pad(x, ((0, 0), (0, 24)))
    want = mx.mxfp4_dequantize(*mx.mxfp4_quantize(padded))[:, :40]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_fake_quant_mxfp8_clips_and_matches_oracle():
    x = _mixed(13, rows=4)
    out = np.asarray(jax.jit(lambda x: mx.fake_quant_mxfp8(x, axis=-1, rule="floor"))(jnp.asarray(x)))
    want = ref.dequantize(*ref.quantize(x, "e4m3", "floor"), "e4m3")
    np.testing.assert_array_equal(out, want.astype(np.float32))
    assert np.isfinite(out).all()
    # floor puts a/scale in [256, 512): the block max clips to 448 * scale rather than casting to NaN
    blk = np.full((1, 32), 1.0, np.float32)
    blk[0, 0] = 1.99
    got = np.asarray(mx.fake_quant_mxfp8(jnp.asarray(blk), rule="floor"))
    assert got[0, 0] == 448 * 2.0**-8 and math.isfinite(got[0, 0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rule", RULES)
def test_elementwise_mxfp8_qdq_equals_blocked_qdq(dtype, rule):
    """``mxfp8_qdq_elementwise`` (the kernels' form: each element with its block's max) gives ``qdq``'s bits on
    mixed magnitudes, ties, -0, zero blocks, subnormal scales and results, saturating values and an Inf block."""
    with np.errstate(over="ignore"):  # the top of _mixed's range times 2^100 is +-Inf in float32: Inf blocks too
        x = np.concatenate([_mixed(0), _mixed(1) * 2.0**-100, _mixed(2) * 2.0**100], axis=0).astype(np.float32)
    x[1, 40] = np.inf
    x[2, 33:64:3] = 448.0 * 2.0 ** np.arange(11)  # values past 448 times the block's scale clip
    x = jnp.asarray(x, dtype)
    x32 = mx.flush_subnormals(x.astype(jnp.float32))
    amax = jnp.repeat(jnp.max(jnp.abs(x32).reshape(x.shape[0], -1, 32), -1), 32, axis=1)
    got = mx.mxfp8_qdq_elementwise(x, amax, rule=rule)
    want = mx.qdq(x, axis=-1, fmt="e4m3", rule=rule)
    assert got.dtype == dtype
    both_nan = np.isnan(np.asarray(got, np.float32)) & np.isnan(np.asarray(want, np.float32))
    ut = np.uint16 if dtype == jnp.bfloat16 else np.uint32
    np.testing.assert_array_equal(np.where(both_nan, 0, np.asarray(got).view(ut)),
                                  np.where(both_nan, 0, np.asarray(want).view(ut)))
    assert both_nan[1, 32:64].all()
