"""The loader's fast host paths are bit-identical to the reference transforms, and its host buffers are adopted by
the CPU devices without copies (replicas share one buffer); per-leaf RSS tracking reports a figure."""

import ml_dtypes
import numpy as np
import pytest

from k3jax.checkpoint.host import ALIGN, Scratch, aligned_empty, copy_T, host_transpose
from k3jax.checkpoint.load import load
from k3jax.checkpoint.save import save
from k3jax.config import get_preset
from k3jax.ops.mx import E2M1_VALUES
from k3jax.quant.host import mxfp4_dequantize_np, mxfp4_dequantize_T_into


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _reference_dequant(packed, scale):
    """The original formulation: split nibbles, E2M1 table, ldexp scale per 32-group (float32)."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    vals = E2M1_VALUES[codes]
    s = np.ldexp(np.float32(1), scale.astype(np.int32) - 127).astype(np.float32)
    G = scale.shape[-1]
    return (vals.reshape(*vals.shape[:-1], G, -1) * s[..., None]).reshape(vals.shape)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 6 x 2^127 is inf in float32, as in the reference
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64])
def test_dequantize_T_into_is_bit_exact_for_every_byte(dtype):
    rng = np.random.default_rng(1)
    n_out, n_in = 255, 64  # every scale byte 0x00..0xFE appears (one row each), every packed byte many times
    packed = rng.integers(0, 256, (n_out, n_in // 2), dtype=np.uint8)
    packed[:, 0] = np.arange(n_out, dtype=np.uint8)
    scale = np.repeat(np.arange(n_out, dtype=np.uint8)[:, None], n_in // 32, axis=1)
    want = _reference_dequant(packed, scale)
    np.testing.assert_array_equal(_bits(mxfp4_dequantize_np(packed, scale)), _bits(want))
    dst = aligned_empty((n_in, n_out), dtype)
    mxfp4_dequantize_T_into(dst, packed, scale)
    np.testing.assert_array_equal(_bits(dst), _bits(want.T.astype(dtype)))
    assert np.signbit(dst[1::2][packed.T >> 4 == 8]).all()  # the -0 code keeps its sign


@pytest.mark.parametrize("shape", [(3, 5), (128, 128), (300, 131), (129, 700)])
def test_copy_T_bf16_to_f32_bit_exact(shape):
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**16, shape, dtype=np.uint16)  # all kinds: NaN payloads, inf, subnormals, -0
    src = bits.view(ml_dtypes.bfloat16)
    dst = np.empty(shape[::-1], np.float32)
    copy_T(dst, src)
    np.testing.assert_array_equal(_bits(dst), _bits(src.T.astype(np.float32)))
    f32 = src.astype(np.float32)
    d16 = np.empty(shape[::-1], ml_dtypes.bfloat16)
    with np.errstate(invalid="ignore"):
        copy_T(d16, f32)  # generic path (float32 → bf16), rounding exactly as astype
        want = f32.T.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(_bits(d16), _bits(want))


@pytest.mark.parametrize("shape", [(3, 5), (300, 131), (2, 129, 70)])
def test_host_transpose_is_bit_exact_and_aligned(shape):
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**16, shape, dtype=np.uint16)  # NaN payloads, inf, subnormals, -0
    src = bits.view(ml_dtypes.bfloat16)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        out = host_transpose(src, dtype)
        assert out.shape == (*shape[:-2], shape[-1], shape[-2]) and out.flags.c_contiguous
        assert out.ctypes.data % ALIGN == 0
        np.testing.assert_array_equal(_bits(out), _bits(np.swapaxes(src, -1, -2).astype(dtype)))
    f32 = rng.standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(_bits(host_transpose(f32, np.float32)), _bits(np.swapaxes(f32, -1, -2)))
    with np.errstate(invalid="ignore"):  # narrowing goes through numpy (rounding exactly as astype)
        np.testing.assert_array_equal(_bits(host_transpose(f32, ml_dtypes.bfloat16)),
                                      _bits(np.swapaxes(f32, -1, -2).astype(ml_dtypes.bfloat16)))


def test_scratch_is_reused_and_grows():
    s = Scratch()
    a = s.take((4, 8), np.float32)
    b = s.take((2, 3), np.uint16)
    assert a.ctypes.data == b.ctypes.data and a.ctypes.data % ALIGN == 0
    c = s.take((64, 64), np.float32)
    assert c.shape == (64, 64) and c.nbytes == 64 * 64 * 4 and s.buf.nbytes >= c.nbytes


def test_aligned_empty_alignment():
    for n in (1, 7, 4096, 1 << 20):
        a = aligned_empty((n,), np.uint8)
        assert a.ctypes.data % ALIGN == 0 and a.shape == (n,) and a.flags.c_contiguous


def test_cpu_devices_adopt_host_buffers_and_rss_is_tracked(tmp_path):
    """On CPU a replicated leaf's 8 device shards share one host buffer (no per-replica copy); per-expert shards are
    distinct; load(track_rss=True) reports the per-leaf peak next to the largest leaf."""
    import jax

    if jax.default_backend() != "cpu" or len(jax.devices()) < 2:
        pytest.skip("needs several CPU devices")
    cfg = get_preset("k3-tiny")
    rng = np.random.default_rng(0)
    from k3jax.model import abstract_params

    params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), abstract_params(cfg))
    save(params, cfg, tmp_path / "t")
    stats = {}
    _, p = load(tmp_path / "t", progress=False, stats=stats, track_rss=True)
    emb = p["embed"] if "embed" in p else jax.tree.leaves(p)[0]
    ptrs = {s.data.unsafe_buffer_pointer() for s in emb.addressable_shards}
    assert len(emb.addressable_shards) == len(jax.devices()) and len(ptrs) == 1
    w1 = next(v for k, v in jax.tree_util.tree_flatten_with_path(p)[0] if "experts" in jax.tree_util.keystr(k))
    if w1.shape[0] % len(jax.devices()) == 0:
        assert len({s.data.unsafe_buffer_pointer() for s in w1.addressable_shards}) == len(jax.devices())
    assert set(stats["breakdown"]) >= {"open_headers", "validate", "abstract_tree", "read_decode", "make_arrays"}
    if "leaf_peak_rss_bytes" in stats:  # Linux with /proc/self/clear_refs
        assert stats["leaf_peak_rss_bytes"] >= 0
