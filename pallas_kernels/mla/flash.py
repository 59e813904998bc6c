"""Public entry ``mla_flash``: causal attention over MLA's latent keys (prefill and training), with a custom VJP.

Forward: the Pallas kernel (``flash_kernel.py``): online softmax, key blocks up-projected from the latent inside the
kernel, causal (and document) block skipping; on TPU key blocks sit on a grid axis (any S). Backward, recomputed
from the saved log-sum-exp: on TPU the Pallas kernels of ``flash_bwd_kernel.py`` (dq + weight gradients, dc_kv +
dk_rope); elsewhere ``flash_reference.flash_backward`` (jnp, tiled: only the lower-triangle block pairs, each key
block up-projected once, no [T, S] or [S, N, ·] buffer). ``interpret`` reaches ``pallas_call``; it defaults to
True when the target platform (``pallas_kernels.platform.target_platform``: ``platform=``, else the current mesh's
device, else the default backend) is the CPU. README_flash.md has the FLOP count behind the design and the limits.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops.grouped_matmul import match_varying, varying_struct
from k3jax.ops.segments import runs
from pallas_kernels.mla.flash_bwd_kernel import backward_blocks, backward_costs, flash_bwd_pallas, query_block_bounds
from pallas_kernels.mla.flash_kernel import cost, flash_fwd_pallas
from pallas_kernels.mla.flash_reference import cdiv, flash_backward, key_block_bounds
from pallas_kernels.mxfp4_matmul.api import interpret_mode
from pallas_kernels.platform import target_platform

# (block_q, block_k) per platform. GPU: a [128, 64] score tile and a [128, V] accumulator per program (Triton keeps
# them in registers); TPU: 512 query rows amortise each key block's up-projection (README_flash.md "Cost").
DEFAULT_BLOCKS = {"cpu": (128, 128), "gpu": (128, 64), "tpu": (512, 256)}


@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    bq: int
    bk: int
    platform: str
    interpret: object  # bool, or a hashable interpreter config (pltpu.InterpretParams)
    qoff_static: int | None  # q_offset when one int known at trace time (the cost estimate), else None


def causal_pairs(T: int, S: int, bq: int, bk: int, qoff: int) -> int:
    """(query block, key block) pairs under the causal diagonal for one row: what the kernel visits without
    documents (``key_block_bounds`` on host ints)."""
    nk = cdiv(S, bk)
    return sum(min(max((min(i * bq + bq - 1, T - 1) + qoff) // bk + 1, 0), nk) for i in range(cdiv(T, bq)))


def _pad(x, n: int, axis: int, mode="constant"):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad, mode=mode)


def _forward(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, cfg: _Cfg):
    """(o [B, T, N, V] in q.dtype, max_logit [B, N], lse [B, N, T] fp32)."""
    B, T, N, H = q.shape
    S, R = c_kv.shape[1], c_kv.shape[2]
    Hn, V = w_uk.shape[-1], w_uv.shape[-1]
    Hr = H - Hn
    bq, bk = cfg.bq, cfg.bk
    Tp, Sp = cdiv(T, bq) * bq, cdiv(S, bk) * bk
    dt = jnp.result_type(q, c_kv, k_rope, w_uk, w_uv)                   # the kernel's operand dtype
    bounds = key_block_bounds(B, T, S, bq, bk, qoff, run, krun)
    flat = jnp.concatenate([bounds.reshape(-1), qoff])                  # (lo, hi) per (row, block), then qoff [B]
    qh = _pad(q.astype(dt), Tp, 1).transpose(0, 2, 1, 3)                # [B, N, Tp, H]
    c = _pad(c_kv.astype(dt), Sp, 1)
    r = _pad(k_rope.astype(dt), Sp, 1)
    wk, wv = w_uk.astype(dt).transpose(1, 0, 2), w_uv.astype(dt).transpose(1, 0, 2)
    runp = krunp = None
    if run is not None:
        runp, krunp = _pad(run, Tp, 1, "edge"), _pad(krun, Sp, 1, "edge")
    # a traced offset (scalar or per row) is charged as S - T for every row: the largest offset whose queries fit
    # the keys, so the worst row's count (causal_pairs grows with the offset)
    pairs = B * causal_pairs(T, S, bq, bk, S - T if cfg.qoff_static is None else cfg.qoff_static)
    est = cost(pairs, B=B, N=N, T=T, S=S, R=R, Hn=Hn, Hr=Hr, V=V, bq=bq, bk=bk, itemsize=jnp.dtype(dt).itemsize)
    ins = (q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff)
    o, lse, m = flash_fwd_pallas(qh[..., :Hn], qh[..., Hn:], c, r, wk, wv, flat, runp, krunp, scale=cfg.scale, S=S,
                                 bq=bq, bk=bk, platform=cfg.platform, interpret=cfg.interpret, cost_estimate=est,
                                 out_struct=lambda shape, dtype: varying_struct(shape, dtype, *ins))
    out = o[:, :, :T].transpose(0, 2, 1, 3).astype(q.dtype)
    return out, jnp.max(m[:, :, :T, 0], axis=-1), lse[:, :, :T, 0]


@partial(jax.custom_vjp, nondiff_argnums=(8,))
def _mla_flash(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, cfg):
    o, max_logit, _ = _forward(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, cfg)
    return o, max_logit


def _mla_flash_fwd(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, cfg):
    o, max_logit, lse = _forward(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, cfg)
    return (o, max_logit), (q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, o, lse)


def _backward_pallas(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, o, lse, d_out, cfg: _Cfg):
    """The gradients through ``flash_bwd_kernel`` (TPU layout): the same layouts and padding as ``_forward``, with
    the backward's own blocks (``backward_blocks``: smaller query blocks for fp32 operands, to fit VMEM)."""
    B, T, N, H = q.shape
    S = c_kv.shape[1]
    Hn = w_uk.shape[-1]
    dt = jnp.result_type(q, c_kv, k_rope, w_uk, w_uv)
    bq, bk = backward_blocks(cfg.bq, cfg.bk, jnp.dtype(dt).itemsize)
    Tp, Sp = cdiv(T, bq) * bq, cdiv(S, bk) * bk
    bounds = key_block_bounds(B, T, S, bq, bk, qoff, run, krun)
    flat = jnp.concatenate([bounds.reshape(-1), qoff])
    kflat = jnp.concatenate([query_block_bounds(bounds, Sp // bk).reshape(-1), qoff])
    head_major = lambda x: _pad(x, Tp, 1).transpose(0, 2, 1, 3)  # noqa: E731   [B, N, Tp, ·]
    qh, doh = head_major(q.astype(dt)), head_major(d_out.astype(dt))
    delta = jnp.einsum("btnv,btnv->bnt", d_out.astype(jnp.float32), o.astype(jnp.float32))
    col = lambda x: _pad(x, Tp, 2)[..., None]  # noqa: E731   [B, N, Tp, 1]; padded queries: do = 0, no gradient
    runp = krunp = None
    if run is not None:
        runp, krunp = _pad(run, Tp, 1, "edge"), _pad(krun, Sp, 1, "edge")
    ins = (q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, d_out)
    off = S - T if cfg.qoff_static is None else cfg.qoff_static                 # charged as _forward's
    ests = backward_costs(B * causal_pairs(T, S, bq, bk, off), B=B, N=N, T=T, S=S, R=c_kv.shape[2], Hn=Hn, Hr=H - Hn,
                          V=w_uv.shape[-1], bq=bq, bk=bk, itemsize=jnp.dtype(dt).itemsize, qoff=off)
    dqn, dqr, dwk, dwv, dc, dkr = flash_bwd_pallas(
        qh[..., :Hn], qh[..., Hn:], doh, col(lse), col(delta), _pad(c_kv.astype(dt), Sp, 1),
        _pad(k_rope.astype(dt), Sp, 1), w_uk.astype(dt).transpose(1, 0, 2), w_uv.astype(dt).transpose(1, 0, 2),
        flat, kflat, runp, krunp, scale=cfg.scale, S=S, bq=bq, bk=bk, interpret=cfg.interpret,
        out_struct=lambda shape, dtype: varying_struct(shape, dtype, *ins), cost_estimates=ests)
    dq = jnp.concatenate([dqn, dqr], axis=-1)[:, :, :T].transpose(0, 2, 1, 3)
    # inside shard_map: latent rows / weights shared by the shards' queries sum their cotangents
    return (match_varying(dq, q).astype(q.dtype), match_varying(dc[:, :S], c_kv).astype(c_kv.dtype),
            match_varying(dkr[:, :S], k_rope).astype(k_rope.dtype),
            match_varying(dwk.transpose(1, 0, 2), w_uk).astype(w_uk.dtype),
            match_varying(dwv.transpose(1, 0, 2), w_uv).astype(w_uv.dtype))


def _mla_flash_bwd(cfg, res, cts):
    q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, o, lse = res
    d_out, _ = cts  # the max-logit output carries no gradient
    if cfg.platform == "tpu":
        grads = _backward_pallas(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, o, lse, d_out, cfg)
    else:
        grads = flash_backward(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, o, lse, d_out, scale=cfg.scale,
                               bq=cfg.bq, bk=cfg.bk)
    return (*grads, None, None, None)


_mla_flash.defvjp(_mla_flash_fwd, _mla_flash_bwd)


def _block(size: int | None, default: int, n: int, platform: str) -> int:
    """The block size: the caller's, else the platform default shrunk to the (padded) length: a power of two
    >= 16 on GPU (Triton tiles), a multiple of 8 elsewhere."""
    if size is not None:
        return int(size)
    if platform == "gpu":
        return min(default, max(16, 1 << (n - 1).bit_length()))
    return min(default, cdiv(n, 8) * 8)


def mla_flash(q, c_kv, k_rope, w_uk, w_uv, *, scale: float, segment_ids=None, key_segment_ids=None, q_offset=None,
              block_q: int | None = None, block_k: int | None = None, platform: str | None = None,
              interpret=None, cost_offset: int | None = None):
    """Causal attention of q over the keys / values MLA's latent stands for. Returns (o [B, T, N, V] in q.dtype,
    max_logit [B, N] (the QK-Clip statistic, no gradient)).

    q [B, T, N, Hn+Hr] (the rope-sized slice last), c_kv [B, S, R], k_rope [B, S, Hr], w_uk [R, N, Hn],
    w_uv [R, N, V]. Same result as ``k3jax.ops.attention.causal_attention(q, k, v, ...)`` with
    k = concat(c_kv · w_uk, broadcast(k_rope)) and v = c_kv · w_uv, and the same ``q_offset`` (int or traced int32
    scalar; default S - T), ``segment_ids`` [B, T] and ``key_segment_ids`` [B, S] rules. ``q_offset`` may also be
    per row, int32 [B]: query t of row b sits at position q_offset[b] + t and sees keys j ≤ that position (cached
    prefill pieces: the rows' cached lengths); the block bounds and masks follow each row, forward and backward.
    The kernel's dots take operands in the inputs' promoted dtype and accumulate in fp32. ``block_q`` /
    ``block_k``: None = the platform's ``DEFAULT_BLOCKS`` (need not divide T or S: padded and masked).
    ``platform``: "cpu", "gpu" ("cuda", "rocm") or "tpu" (None: ``target_platform()``); ``interpret`` None =
    platform is "cpu", or an interpreter config passed on to ``pallas_call`` (``pltpu.InterpretParams()``: the one
    that runs inside shard_map). ``cost_offset``: the query offset the cost estimate charges when ``q_offset`` is
    traced (default S - T: the most keys a query can see); a caller that knows the mean offset of its calls (the
    context-parallel mirror split: a shard's two halves sum to the same work on every shard) passes it."""
    if q.ndim != 4 or c_kv.ndim != 3 or k_rope.ndim != 3 or w_uk.ndim != 3 or w_uv.ndim != 3:
        raise ValueError(f"mla_flash: want q [B, T, N, H], c_kv [B, S, R], k_rope [B, S, Hr], w_uk [R, N, Hn], "
                         f"w_uv [R, N, V]; got {q.shape}, {c_kv.shape}, {k_rope.shape}, {w_uk.shape}, {w_uv.shape}")
    B, T, N, H = q.shape
    S, R = c_kv.shape[1], c_kv.shape[2]
    Hn, Hr = w_uk.shape[-1], k_rope.shape[-1]
    if (c_kv.shape[0], k_rope.shape[:2], w_uk.shape[:2], w_uv.shape[:2], H) != (B, (B, S), (R, N), (R, N), Hn + Hr):
        raise ValueError(f"mla_flash: incompatible shapes q {q.shape}, c_kv {c_kv.shape}, k_rope {k_rope.shape}, "
                         f"w_uk {w_uk.shape}, w_uv {w_uv.shape}")
    if T > S:
        raise ValueError(f"mla_flash: more queries ({T}) than keys ({S})")
    platform = target_platform(platform)
    if interpret is None or isinstance(interpret, bool | int):
        interpret = platform == "cpu" if interpret is None else bool(interpret)
    interpret = interpret_mode(interpret, q, c_kv, k_rope, w_uk, w_uv)   # inside shard_map: the TPU interpreter
    dq, dk = DEFAULT_BLOCKS[platform]
    bq, bk = _block(block_q, dq, T, platform), _block(block_k, dk, S, platform)
    static = S - T if q_offset is None else (q_offset if isinstance(q_offset, int) else cost_offset)
    qoff = jnp.asarray(S - T if q_offset is None else q_offset, jnp.int32)
    if qoff.ndim > 1 or (qoff.ndim == 1 and qoff.shape != (B,)):
        raise ValueError(f"mla_flash: q_offset must be a scalar or [B] = [{B}]; got shape {tuple(qoff.shape)}")
    qoff = jnp.broadcast_to(qoff, (B,))                                    # per row from here on
    run = krun = None
    if segment_ids is not None:
        keys = segment_ids if key_segment_ids is None else key_segment_ids
        if tuple(keys.shape) != (B, S) or tuple(segment_ids.shape) != (B, T) or (key_segment_ids is None and T != S):
            raise ValueError(f"mla_flash: segment_ids {tuple(segment_ids.shape)} need queries = keys [B, T] = "
                             f"{(B, T)} (keys {S}), or key_segment_ids [B, S]")
        krun = runs(keys)
        run = krun if T == S and key_segment_ids is None else jax.vmap(
            lambda k, o: lax.dynamic_slice_in_dim(k, o, T))(krun, qoff)
    cfg = _Cfg(float(scale), bq, bk, platform, interpret, static)
    return _mla_flash(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, cfg)


__all__ = ["DEFAULT_BLOCKS", "causal_pairs", "mla_flash"]
