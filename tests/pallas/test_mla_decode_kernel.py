"""The absorbed MLA decode kernel (pallas_kernels/mla/decode*.py) against its jnp rungs and k3jax.ops.latent_attention.

Ladder: ``latent_attention`` (materialized, then absorbed) → ``mla_decode_reference`` (one masked softmax) and
``decode_partials_reference`` (each split's (õ, m, l)) → the kernel, in interpret mode on CPU for each schedule:
"cpu" (the loop schedule over all query rows), "gpu" (the same loop in Triton's 32-row tiles, padded rows) and
"tpu" (scalar-prefetched grid). Rows are ragged: kv_len 0, mid-block and the full cache, q_pos rising inside a row
and past kv_len; splits that do not divide a row's blocks, and more splits than blocks (empty splits). Blocks wholly
past a row's keys hold NaN for the kernel, so reading one would show. Lowering: Triton for an abstract H200 at K3's
shapes (T = 1 and T = 8). The TPU compile at K3's shapes runs in tests/pallas/test_targets.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.latent_attention import latent_attention
from k3jax.testing import TOL, assert_close
from pallas_kernels.mla.decode import (
    check_tiling,
    combine_splits,
    decode_inputs,
    default_block_kv,
    default_num_splits,
    mla_decode,
)
from pallas_kernels.mla.decode_kernel import NEG, decode_cost, partials_loop, partials_tpu
from pallas_kernels.mla.decode_reference import decode_partials_reference, mla_decode_reference
from pallas_kernels.platform import target_platform

N, HN, HR, R, V = 2, 16, 16, 32, 16     # Hr = 16: Triton's smallest dot, so "gpu" runs these shapes too
SCALE = (HN + HR) ** -0.5
# (cache length S, key block) per schedule: four blocks a row. The TPU schedule reads k_rope keys-minor (Hr < 128),
# so its key blocks are whole 128-lane tiles.
GEOMETRY = {"cpu": (64, 16), "gpu": (64, 16), "tpu": (512, 128)}


def _kv_len(S):
    """No key, mid-block (37 of every 64 keys: 3 of 4 blocks), the whole cache."""
    return np.array([0, 37 * S // 64, S])


def _q_pos(T, S):
    """[B, T] rising positions: row 0 past its (empty) cache, row 1 ending 2 - T // 2 keys before its kv_len (past
    its last key at T = 8), row 2 ending at S - 1."""
    t = np.arange(T)
    return jnp.asarray(np.stack([t, _kv_len(S)[1] - 3 - T // 2 + t, S - T + t]), jnp.int32)


def _inputs(T, S, dtype=jnp.float32, layers=None, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    B = 3
    lead = () if layers is None else (layers,)
    c, r = f(*lead, B, S, R).astype(dtype), f(*lead, B, S, HR).astype(dtype)
    return dict(q_nope=f(B, T, N, HN), q_rope=f(B, T, N, HR), c_kv=c, k_rope=r, w_uk=0.3 * f(R, N, HN),
                w_uv=f(R, N, V)), dict(q_pos=_q_pos(T, S), kv_len=jnp.asarray(_kv_len(S), jnp.int32))


def _poison(x, block):
    """NaN in every key block wholly past a row's kv_len (axis -2 = keys, axis -3 = rows)."""
    S = x.shape[-2]
    first = -(-_kv_len(S) // block) * block
    past = np.arange(S)[None, :] >= first[:, None]                                   # [B, S]
    return jnp.where(jnp.asarray(past)[..., None], jnp.nan, x)


def _kernel(a, pos, *, platform, block, splits=3, layer=None):
    args = dict(a, c_kv=_poison(a["c_kv"], block), k_rope=_poison(a["k_rope"], block))
    f = functools.partial(mla_decode, scale=SCALE, block_kv=block, num_splits=splits, platform=platform,
                          interpret=True)
    return jax.jit(f)(**args, **pos, layer=layer)   # one compile: eager dispatch re-lowers the interpreted kernel


def _latent(a, pos, *, block, absorbed=True, layer=None):
    f = functools.partial(latent_attention, scale=SCALE, block=block, absorbed=absorbed)
    return jax.jit(f)(**a, **pos, layer=layer)


# default: T = 1, 4, 8 over the loop schedule's two configurations; the TPU schedule's default-suite checks are
# test_partials_match_reference[tpu] and test_stacked_layer_reads_its_layer
@pytest.mark.parametrize("platform,T", [("cpu", 1), ("cpu", 8), ("gpu", 4),
                                        pytest.param("tpu", 4, marks=pytest.mark.slow),
                                        pytest.param("cpu", 4, marks=pytest.mark.slow),
                                        pytest.param("gpu", 8, marks=pytest.mark.slow),
                                        pytest.param("tpu", 1, marks=pytest.mark.slow),
                                        pytest.param("tpu", 8, marks=pytest.mark.slow)],
                         ids=lambda v: f"T{v}" if isinstance(v, int) else v)
def test_matches_latent_attention(platform, T):
    S, block = GEOMETRY[platform]
    a, pos = _inputs(T, S)
    o = _kernel(a, pos, platform=platform, block=block)
    absorbed, materialized = _latent(a, pos, block=block), _latent(a, pos, block=block, absorbed=False)
    reference = jax.jit(functools.partial(mla_decode_reference, scale=SCALE))(**a, **pos)
    assert o.shape == (3, T, N, V) and o.dtype == jnp.float32
    assert_close(o, absorbed, TOL["fp32_shallow"], name="vs absorbed")
    assert_close(o, materialized, TOL["fp32_shallow"], name="vs materialized")
    assert_close(o, reference, TOL["fp32_shallow"], name="vs reference")
    np.testing.assert_array_equal(np.asarray(o)[0], 0.0)            # kv_len 0: no key, exactly 0


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_partials_match_reference(platform):
    """Each split's (õ, m, l) from stacked caches (layer 1 of 2), with 5 splits over at most 4 blocks a row: empty
    splits give (0, finfo.min, 0)."""
    S, block = GEOMETRY[platform]
    a, pos = _inputs(4, S, layers=2)
    splits = 5
    ins = decode_inputs(a["q_nope"], a["q_rope"], a["c_kv"], a["k_rope"], a["w_uk"], **pos, block_kv=block,
                        layer=jnp.int32(1))
    q_lat, q_r, limit, n_blocks, c4, r4, lay = ins
    np.testing.assert_array_equal(n_blocks, [0, 3, 4])   # rows stop at min(kv_len, last q_pos + 1) keys
    poisoned = (_poison(c4, block), _poison(r4, block))
    if platform == "tpu":
        o, m, l = partials_tpu(q_lat, q_r, limit[..., None], n_blocks, *poisoned, lay, block_kv=block,
                               num_splits=splits, scale=SCALE, interpret=True)
        m, l = m[..., 0], l[..., 0]
    else:
        o, m, l = partials_loop(q_lat, q_r, limit, n_blocks, *poisoned, lay, block_kv=block, block_m=limit.shape[1],
                                num_splits=splits, scale=SCALE, platform=platform, interpret=True)
    ro, rm, rl = decode_partials_reference(*ins, block_kv=block, num_splits=splits, scale=SCALE, neg=NEG)
    assert_close(o, ro, TOL["fp32_shallow"], name="o")
    assert_close(l, rl, TOL["fp32_shallow"], name="l")
    np.testing.assert_allclose(m, rm, rtol=1e-6)
    empty = np.asarray(rl) == 0
    assert empty[0].all() and empty[1, 3:].all() and not empty[1, :3].any()
    assert empty[2, 4:].all() and not empty[2, :4].any()
    np.testing.assert_array_equal(np.asarray(m)[empty], NEG)
    np.testing.assert_array_equal(np.asarray(o)[empty], 0.0)


def test_stacked_layer_reads_its_layer():
    """The TPU schedule's layer index (scalar-prefetched into the cache's index maps) against the layer's slice."""
    S, block = GEOMETRY["tpu"]
    a, pos = _inputs(2, S, layers=3, seed=1)
    o = _kernel(a, pos, platform="tpu", block=block, layer=jnp.int32(2), splits=2)
    assert_close(o, _latent(a, pos, block=block, layer=jnp.int32(2)), TOL["fp32_shallow"], name="layer 2")
    flat = dict(a, c_kv=a["c_kv"][2], k_rope=a["k_rope"][2])
    assert_close(o, _latent(flat, pos, block=block), TOL["fp32_shallow"], name="layer 2 sliced")


def test_bf16_cache():
    """bf16 latents (the model's cache in a bf16 run) on the Triton configuration: the kernel's matmul operands are
    bf16 (q̃ and p rounded), fp32 accumulation, against latent_attention's fp32 products of the same cache."""
    a, pos = _inputs(4, 64, dtype=jnp.bfloat16, seed=2)
    o = _kernel(a, pos, platform="gpu", block=32, splits=2)
    want = _latent(a, pos, block=16)
    assert o.dtype == jnp.float32
    assert_close(o, want, TOL["bf16"], name="bf16 cache")


def test_block_kv_must_divide_cache():
    a, pos = _inputs(1, 64)
    with pytest.raises(ValueError, match="mla_decode: block_kv 24 must divide the cache length S = 64"):
        mla_decode(**a, **pos, scale=SCALE, block_kv=24, platform="cpu")


def test_untileable_caches_are_rejected():
    with pytest.raises(ValueError, match="mla_decode: the Triton schedule cannot tile a key rope width Hr of 8"):
        check_tiling(64, 32, 8, 16, jnp.bfloat16, "gpu")
    with pytest.raises(ValueError, match="mla_decode: the Triton schedule cannot tile a latent width R of 96"):
        check_tiling(64, 96, 64, 16, jnp.bfloat16, "gpu")
    with pytest.raises(ValueError, match="mla_decode: TPU key block 64 must be a multiple of 128 for a bfloat16 "
                                         "cache with Hr = 64"):
        check_tiling(8192, 512, 64, 64, jnp.bfloat16, "tpu")   # k_rope keys-minor: whole lanes
    with pytest.raises(ValueError, match="mla_decode: TPU key block 8 must be a multiple of 16 for a bfloat16"):
        check_tiling(64, 32, 128, 8, jnp.bfloat16, "tpu")
    check_tiling(64, 32, 128, 8, jnp.float32, "tpu")     # Hr = 128: keys are sublanes, 8 of them in fp32
    check_tiling(24, 32, 16, 24, jnp.bfloat16, "tpu")    # the whole axis is always a block
    a, pos = _inputs(1, 64)
    with pytest.raises(ValueError, match="layer index goes with caches stacked"):
        mla_decode(**a, **pos, scale=SCALE, layer=jnp.int32(0), platform="cpu")


def test_defaults():
    assert target_platform() == "cpu"
    assert [default_block_kv(8192, p) for p in ("tpu", "gpu", "cpu")] == [512, 64, 512]
    assert default_block_kv(100, "cpu") == 100 and default_block_kv(96 * 16, "tpu") == 512
    assert default_block_kv(3 * 1024 + 64, "tpu") == 64
    assert default_num_splits(1, 24, 128, "gpu") == 6 and default_num_splits(64, 3, 128, "gpu") == 1
    assert default_num_splits(1, 1, 16, "tpu") == 2 and default_num_splits(4, 1, 16, "tpu") == 1
    assert default_num_splits(1, 1, 16, "cpu") == 1 and default_num_splits(1, 24, 2, "gpu") == 2
    assert default_num_splits(1, 3, 128, "gpu", max_splits=11) == 11 and default_num_splits(1, 1, 8, "tpu", 0) == 1


def test_combine_splits_weighs_empty_splits_zero():
    rng = np.random.default_rng(3)
    o = jnp.asarray(rng.standard_normal((1, 3, 2, 4)), jnp.float32)
    m = jnp.asarray([[[1.0, NEG], [NEG, NEG], [3.0, NEG]]], jnp.float32)
    l = jnp.asarray([[[2.0, 0.0], [0.0, 0.0], [0.5, 0.0]]], jnp.float32)
    o = o.at[:, 1].set(0.0).at[:, :, 1].set(0.0)
    got = combine_splits(o, m, l)
    w0, w2 = np.exp(1.0 - 3.0), 1.0
    want = (w0 * np.asarray(o)[0, 0, 0] + w2 * np.asarray(o)[0, 2, 0]) / (w0 * 2.0 + w2 * 0.5)
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-6)
    np.testing.assert_array_equal(got[0, 1], 0.0)                    # no key in any split


def test_cost_estimate_charges_the_whole_cache():
    """K3, B = 1, T = 1, S = 8192, bf16: the latents of the full cache once, 2·M·S·(2R + Hr) flops."""
    c = decode_cost(B=1, M=96, S=8192, R=512, Hr=64, splits=6, itemsize=2)
    latents = 8192 * (512 + 64) * 2
    assert c["flops"] == 2 * 96 * 8192 * (2 * 512 + 64) and c["transcendentals"] == 96 * 8192
    assert c["bytes_accessed"] == latents + 96 * (576 * 2 + 4) + 6 * 96 * 514 * 4


# ---------------------------------------------------------------------------------------------------------------
# Triton lowering for an abstract H200 at K3's shapes (the recipe of tests/pallas/test_targets.py)

TRITON_CALL = "__gpu$xla.gpu.triton"
K3 = dict(N=96, Hn=128, Hr=64, R=512, V=128, S=8192, B=1)


def _k3_args(T, layers=None):
    d = K3
    lead = () if layers is None else (layers,)
    bf = jnp.bfloat16
    s = jax.ShapeDtypeStruct
    args = [s((d["B"], T, d["N"], d["Hn"]), bf), s((d["B"], T, d["N"], d["Hr"]), bf),
            s((*lead, d["B"], d["S"], d["R"]), bf), s((*lead, d["B"], d["S"], d["Hr"]), bf),
            s((d["R"], d["N"], d["Hn"]), bf), s((d["R"], d["N"], d["V"]), bf), s((d["B"], T), jnp.int32),
            s((d["B"],), jnp.int32)]
    return args + ([s((), jnp.int32)] if layers else [])


def _k3_decode(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos, kv_len, layer=None):
    return mla_decode(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos=q_pos, kv_len=kv_len,
                      scale=(K3["Hn"] + K3["Hr"]) ** -0.5, layer=layer, interpret=False)


@pytest.mark.parametrize("T,layers", [(1, None), (8, 61)], ids=["T1", "T8-stacked"])
def test_lowers_for_cuda(T, layers):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        assert target_platform() == "gpu"
        exported = jax.export.export(jax.jit(_k3_decode), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*_k3_args(T, layers))
    text = exported.mlir_module()
    assert f"stablehlo.custom_call @{TRITON_CALL}" in text and "mla_decode_fwd" in text
    # grid (M / 32 row tiles, splits, B): T = 1, 3 tiles: 44 splits would fill 132 SMs, the partials' cap allows 11
    # (8192 · 576 · 2 B of latents // (4 · 96 · 514 · 4 B)); T = 8: 24 tiles, one split's partials already a sixth
    splits = {1: 11, 8: 1}[T]
    assert f"grid_x = {T * K3['N'] // 32} : i32, grid_y = {splits} : i32, grid_z = 1 : i32" in text
