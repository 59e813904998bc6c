"""Public entry ``mla_decode``: absorbed MLA attention over the latent cache with a split-KV Pallas kernel.

Same contract as ``k3jax.ops.latent_attention.latent_attention(absorbed=True)`` (its docstring). The steps:

1. q̃ = q^N W_UK^T (an einsum in the accumulation dtype, then the cache dtype: the kernel's matmul operands);
   the T·N (token, head) pairs of a row become its M = T·N query rows, row t·N + n.
2. Per row: limit_m = min(q_pos[b, t], kv_len[b] - 1) (the last key row m may see) and the row's real key blocks
   n_blocks[b] = ceil(min(kv_len[b], max_t q_pos[b, t] + 1) / block_kv): no key past either bound is read.
3. The kernel (decode_kernel.py) returns per split the online-softmax state (õ [R], m, l) of every query row.
4. ``combine_splits`` merges the splits in jnp: a reduction over at most a few dozen splits that XLA fuses into one
   pass over the fp32 partials, which is all a second kernel could do (the partials must be read once either way),
   and which then feeds the value einsum.
5. o = õ W_UV, once per query (an einsum).

Blocks and schedules per platform (``pallas_kernels.platform.target_platform``): TPU = the ``tpu`` schedule, all M
rows of a batch row per program; GPU = the ``loop`` schedule (Triton) in row tiles of ``GPU_BLOCK_M``; CPU = the
``loop`` schedule in the interpreter, all M rows per program. ``interpret`` defaults to True on the CPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from k3jax.ops.norms import acc_dtype
from pallas_kernels.mla.decode_kernel import TPU_LANES, partials_loop, partials_tpu
from pallas_kernels.platform import target_platform

# Default key block per platform: TPU 512 (a [512, 512] bf16 latent block is 512 KiB of VMEM, double-buffered, next
# to the [M, 512] fp32 accumulator); GPU 64 (Triton, with 32-row tiles: a [32, 64] score tile and a [64, 512] bf16
# latent tile per step); CPU 512 (the interpreter's cost is per block). Powers of two; a cache length that the
# default does not divide gets the largest power of two that does.
DEFAULT_BLOCK_KV = {"tpu": 512, "gpu": 64, "cpu": 512}
GPU_BLOCK_M = 32     # query rows per Triton program (registers: module docstring of decode_kernel.py)
GPU_MIN_DOT = 16     # Triton's tl.dot needs every matmul dimension >= 16
GPU_PROGRAMS = 132   # H100 / H200 streaming multiprocessors: the GPU default splits fill them
# Default splits keep the fp32 partials' traffic (splits · M · (R + 2) · 4 bytes a row) within 1 / PARTIALS_SHARE of
# the row's latent bytes: at K3, T = 8 one split's partials (1.6 MB) are already a sixth of an 8192-key row (9.4 MB).
PARTIALS_SHARE = 4


def default_block_kv(S: int, platform: str) -> int:
    """The platform's default key block for a cache of S keys: ``DEFAULT_BLOCK_KV``, or the largest power of two
    dividing S below it (S itself when S is smaller)."""
    target = DEFAULT_BLOCK_KV[platform]
    if S <= target:
        return S
    return min(target, S & -S)


def default_num_splits(B: int, row_tiles: int, n_blocks: int, platform: str, max_splits: int | None = None) -> int:
    """Splits per row: on GPU enough programs (B · row tiles · splits) to fill ``GPU_PROGRAMS``; on TPU 2 when B = 1
    (both TensorCores of a megacore chip get a split), else 1 (one core walks the grid; splits only add partials);
    in the interpreter 1. Never more than the cache's blocks nor ``max_splits`` (``mla_decode``: the partials'
    share of the traffic, ``PARTIALS_SHARE``)."""
    if platform == "gpu":
        want = -(-GPU_PROGRAMS // (B * row_tiles))
    elif platform == "tpu":
        want = 2 if B == 1 else 1
    else:
        want = 1
    return max(1, min(want, n_blocks, want if max_splits is None else max_splits))


def check_tiling(S: int, R: int, Hr: int, block_kv: int, dtype, platform: str) -> None:
    """ValueError naming the kernel and the reason when the cache cannot be tiled with key blocks of block_kv."""
    if block_kv <= 0 or S % block_kv:
        raise ValueError(f"mla_decode: block_kv {block_kv} must divide the cache length S = {S}")
    if platform == "tpu":
        # Mosaic's tile: keys are the second-minor dim of c_kv's blocks, 8 (fp32) or 16 (bf16) rows, and the minor
        # (lane) dim of k_rope's when Hr < 128 (decode_kernel.partials_tpu reads it keys-minor)
        step = TPU_LANES if Hr < TPU_LANES else 32 // jnp.dtype(dtype).itemsize
        if block_kv % step and block_kv != S:
            raise ValueError(f"mla_decode: TPU key block {block_kv} must be a multiple of {step} for a "
                             f"{jnp.dtype(dtype).name} cache with Hr = {Hr} (Mosaic's tile), or the whole cache "
                             f"length {S}")
    elif platform == "gpu":
        for name, size in (("key block block_kv", block_kv), ("latent width R", R), ("key rope width Hr", Hr)):
            if size & (size - 1) or size < GPU_MIN_DOT:
                raise ValueError(f"mla_decode: the Triton schedule cannot tile a {name} of {size}: it needs a power "
                                 f"of two >= {GPU_MIN_DOT}")


def combine_splits(o, m, l):
    """Merge per-split online-softmax states. o [B, P, M, R], m, l [B, P, M] fp32 → õ / l [B, M, R]; 0 for a
    query row with no key in any split (l = 0). A split with no key (m = finfo.min, l = 0) weighs exactly 0 next
    to one with keys, and exp(0) · 0 when no split has any."""
    m_all = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - m_all)                                                        # [B, P, M]
    l_all = jnp.sum(w * l, axis=1)
    o_all = jnp.einsum("bpm,bpmr->bmr", w, o)
    return jnp.where(l_all[..., None] > 0, o_all / jnp.where(l_all > 0, l_all, 1)[..., None], 0)


def decode_inputs(q_nope, q_rope, c_kv, k_rope, w_uk, *, q_pos, kv_len, block_kv: int, layer):
    """Steps 1-2 of the module docstring: (q_lat [B, M, R], q_rope [B, M, Hr] in the cache dtype, limit [B, M]
    int32, n_blocks [B] int32, c_kv [L, B, S, R], k_rope [L, B, S, Hr], layer [1] int32)."""
    B, T, N, _ = q_nope.shape
    cdt = c_kv.dtype
    acc = acc_dtype(q_nope.dtype)
    if layer is None:
        c_kv, k_rope, layer = c_kv[None], k_rope[None], 0      # [1, B, S, .]: a reshape, no copy
    # clamped like lax.dynamic_slice's start (latent_attention's read): the TPU index maps must stay in bounds
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, c_kv.shape[0] - 1)
    S = c_kv.shape[2]
    # q̃ = q^N W_UK^T with fp32 accumulation of the operands as given (bf16 products are exact in fp32): upcasting
    # W_UK first made XLA keep an fp32 copy of it per call (25 MB at K3, seen in the TPU compile's temporaries)
    q_lat = jnp.einsum("btnh,rnh->btnr", q_nope, w_uk, preferred_element_type=acc).astype(cdt)
    kv_len = jnp.asarray(kv_len, jnp.int32)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    limit = jnp.minimum(q_pos, kv_len[:, None] - 1)                                               # [B, T]
    keys = jnp.clip(jnp.minimum(kv_len, jnp.max(q_pos, axis=1) + 1), 0, S)
    n_blocks = ((keys + block_kv - 1) // block_kv).astype(jnp.int32)
    M = T * N
    return (q_lat.reshape(B, M, -1), q_rope.astype(cdt).reshape(B, M, -1),
            jnp.repeat(limit, N, axis=1), n_blocks, c_kv, k_rope, layer.reshape(1))


def mla_decode(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, q_pos, kv_len, scale: float, block_kv: int | None = None,
               num_splits: int | None = None, layer=None, platform: str | None = None, interpret: bool | None = None):
    """→ o [B, T, N, V] in at-least-fp32: ``latent_attention(..., absorbed=True)`` with the split-KV kernel.

    q_nope [B, T, N, Hn], q_rope [B, T, N, Hr]; c_kv [B, S, R] and k_rope [B, S, Hr] in one dtype (bf16 or fp32), or
    both stacked over layers ([L, B, S, .]) with ``layer`` an int32 index; w_uk [R, N, Hn], w_uv [R, N, V]; q_pos
    [B, T], kv_len [B]. Query (b, t) sees keys j <= q_pos[b, t] and j < kv_len[b]; a query with no key gives 0.
    block_kv: key block (a divisor of S; default ``default_block_kv``). num_splits: splits of each row's real key
    blocks (default ``default_num_splits``). platform: 'cpu', 'gpu' ('cuda', 'rocm') or 'tpu' (None:
    ``target_platform()``) picks the schedule and blocks; interpret None = platform is 'cpu'.
    The matmul operands are in the cache dtype (q̃ is rounded to it), accumulation in fp32.
    """
    B, T, N, Hn = q_nope.shape
    stacked = c_kv.ndim == 4
    if stacked != (layer is not None) or k_rope.ndim != c_kv.ndim:
        raise ValueError(f"mla_decode: a layer index goes with caches stacked over layers (c_kv {c_kv.shape}, "
                         f"k_rope {k_rope.shape}, layer {'None' if layer is None else 'given'})")
    S, R, Hr = c_kv.shape[-2], c_kv.shape[-1], k_rope.shape[-1]
    V = w_uv.shape[-1]
    if (w_uk.shape != (R, N, Hn) or w_uv.shape[:2] != (R, N) or k_rope.shape[-3:-1] != c_kv.shape[-3:-1]
            or c_kv.shape[-3] != B or q_rope.shape != (B, T, N, Hr)):
        raise ValueError(f"mla_decode: incompatible shapes q_nope {q_nope.shape}, q_rope {q_rope.shape}, c_kv "
                         f"{c_kv.shape}, k_rope {k_rope.shape}, w_uk {w_uk.shape}, w_uv {w_uv.shape}")
    if k_rope.dtype != c_kv.dtype:
        raise ValueError(f"mla_decode: k_rope ({k_rope.dtype}) must have the latent's dtype ({c_kv.dtype})")
    platform = target_platform(platform)
    interpret = platform == "cpu" if interpret is None else bool(interpret)
    block_kv = default_block_kv(S, platform) if block_kv is None else int(block_kv)
    check_tiling(S, R, Hr, block_kv, c_kv.dtype, platform)
    M = T * N
    block_m = M if platform != "gpu" else GPU_BLOCK_M
    Mp = -(-M // block_m) * block_m
    if num_splits is None:
        cap = S * (R + Hr) * c_kv.dtype.itemsize // (PARTIALS_SHARE * M * (R + 2) * 4)
        splits = default_num_splits(B, Mp // block_m, S // block_kv, platform, max_splits=cap)
    else:
        splits = int(num_splits)
    if splits < 1:
        raise ValueError(f"mla_decode: num_splits must be >= 1, got {splits}")
    q_lat, q_r, limit, n_blocks, c4, r4, lay = decode_inputs(q_nope, q_rope, c_kv, k_rope, w_uk, q_pos=q_pos,
                                                             kv_len=kv_len, block_kv=block_kv, layer=layer)
    scale = float(scale)
    if platform == "tpu":
        o, m, l = partials_tpu(q_lat, q_r, limit[..., None], n_blocks, c4, r4, lay, block_kv=block_kv,
                               num_splits=splits, scale=scale, interpret=interpret)
        m, l = m[..., 0], l[..., 0]
    else:
        if Mp != M:   # Triton row tiles: padded rows see no key (limit -1) and are dropped
            pad = lambda x, v: jnp.pad(x, [(0, 0), (0, Mp - M)] + [(0, 0)] * (x.ndim - 2), constant_values=v)  # noqa: E731
            q_lat, q_r, limit = pad(q_lat, 0), pad(q_r, 0), pad(limit, -1)
        o, m, l = partials_loop(q_lat, q_r, limit, n_blocks, c4, r4, lay, block_kv=block_kv, block_m=block_m,
                                num_splits=splits, scale=scale, platform=platform, interpret=interpret)
        o, m, l = o[:, :, :M], m[:, :, :M], l[:, :, :M]
    acc = acc_dtype(q_nope.dtype)
    o_lat = combine_splits(o, m, l).reshape(B, T, N, R).astype(acc)
    return jnp.einsum("btnr,rnv->btnv", o_lat, w_uv.astype(acc)).reshape(B, T, N, V)              # o = õ W_UV


__all__ = ["DEFAULT_BLOCK_KV", "PARTIALS_SHARE", "check_tiling", "combine_splits", "decode_inputs", "default_block_kv",
           "default_num_splits", "mla_decode"]
