"""Rotary position embedding with DeepSeek-style YaRN scaling, for the speculative draft's MLA (k3jax/draft/).

K3's own MLA is NoPE: nothing in the target is rotated. The DSpark draft is a DeepSeek-V3-style MLA whose 64-d rope
slice (queries per head, the one shared key) IS rotated, with YaRN frequencies:

    f_i      = theta^(-2i/Hr)                                  i = 0 .. Hr/2-1
    d(b)     = Hr · ln(L0 / (2π b)) / (2 ln theta)             the pair index that turns b times over L0 positions
    lo, hi   = max(floor(d(beta_fast)), 0), min(ceil(d(beta_slow)), Hr-1)
    ramp_i   = clip((i - lo) / (hi - lo), 0, 1)                (hi += 0.001 when lo == hi)
    f'_i     = f_i / factor · ramp_i + f_i · (1 - ramp_i)      pairs i < lo keep f_i, pairs i > hi get f_i / factor
    m(s, a)  = 0.1 · a · ln(s) + 1 for s > 1, else 1
    cos/sin  scaled by m(factor, mscale) / m(factor, mscale_all_dim)
    softmax scale multiplied by m(factor, mscale_all_dim)^2

with L0 = original_max_position_embeddings: DeepSeek-V3's reference and vLLM's ``DeepseekScalingRotaryEmbedding``
(floor / ceil on the correction range). Without scaling it is plain RoPE (f'_i = f_i, both factors 1).

Convention: INTERLEAVED pairs. Channels (2i, 2i+1) of the slice form pair i, rotated by angle p · f'_i:

    y_{2i}   = x_{2i} cos − x_{2i+1} sin,      y_{2i+1} = x_{2i} sin + x_{2i+1} cos

This is how DeepSeek-V3's reference code rotates (``view_as_complex`` over adjacent pairs) and what vLLM runs for
DeepSeek MLA (``is_neox_style=False``); HF's deepseek_v3 reaches the same result by permuting the slice to halves and
applying rotate-half. So the weights of an official checkpoint (q_b_proj's rope columns, kv_a_proj_with_mqa's last
Hr rows) work here as stored, with no permutation. A checkpoint trained under the rotate-half (neox) convention would
need its rope rows permuted (even channels first, then odd) before loading.

Angles are computed in the accumulation dtype of x (fp32, fp64 in float64 tests) from int32 positions, as vLLM
does in fp32: at a position of 1M an fp32 angle carries ~0.06 rad of rounding for the fastest pair.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from k3jax.ops.norms import acc_dtype


class YarnScaling(NamedTuple):
    """DeepSeek-style YaRN settings (HF ``rope_scaling`` with ``type`` / ``rope_type`` "yarn")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


class RopeSpec(NamedTuple):
    """What a rotation needs: per-pair inverse frequencies and the two YaRN scale factors (static numbers)."""

    inv_freq: tuple[float, ...]  # [Hr/2]
    cos_sin_scale: float  # multiplies cos and sin (so both q^R and k^R)
    attn_scale: float  # multiplies the softmax scale 1/sqrt(Hn + Hr)


def yarn_mscale(factor: float, mscale: float) -> float:
    """m(s, a) = 0.1 · a · ln(s) + 1 for s > 1, else 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_correction_range(dim: int, theta: float, scaling: YarnScaling) -> tuple[int, int]:
    """(lo, hi): the pair indices between which YaRN ramps from the original to the interpolated frequency."""

    def turns_dim(turns: float) -> float:
        L0 = scaling.original_max_position_embeddings
        return dim * math.log(L0 / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo = math.floor(turns_dim(scaling.beta_fast))
    hi = math.ceil(turns_dim(scaling.beta_slow))
    return max(lo, 0), min(hi, dim - 1)


def rope_spec(dim: int, theta: float, scaling: YarnScaling | None = None) -> RopeSpec:
    """The rotation of a ``dim``-channel slice (even) at base ``theta``; YaRN when ``scaling`` is given."""
    if dim % 2:
        raise ValueError(f"rotary dim {dim} must be even")
    freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if scaling is None:
        return RopeSpec(tuple(float(f) for f in freq), 1.0, 1.0)
    lo, hi = yarn_correction_range(dim, theta, scaling)
    hi = hi + 0.001 if lo == hi else hi
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
    freq = freq / scaling.factor * ramp + freq * (1.0 - ramp)
    cs = yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return RopeSpec(tuple(float(f) for f in freq), cs, yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2)


def apply_rope(x, positions, spec: RopeSpec):
    """Rotate the interleaved pairs of x's last axis.

    x: [B, T, Hr] or [B, T, N, Hr], any float dtype. positions: [B, T] integer positions.
    Returns the rotated x in x's accumulation dtype (fp32 for bf16 / fp32 inputs).
    """
    acc = acc_dtype(x.dtype)
    Hr = x.shape[-1]
    if Hr != 2 * len(spec.inv_freq):
        raise ValueError(f"rope slice of {Hr} channels, but the spec has {len(spec.inv_freq)} pairs")
    pos = jnp.asarray(positions).astype(acc).reshape(positions.shape + (1,) * (x.ndim - 1 - positions.ndim))
    angle = pos[..., None] * jnp.asarray(spec.inv_freq, acc)                        # [B, T, (1,) Hr/2]
    cos, sin = jnp.cos(angle) * spec.cos_sin_scale, jnp.sin(angle) * spec.cos_sin_scale
    pairs = x.astype(acc).reshape(x.shape[:-1] + (Hr // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)


__all__ = ["RopeSpec", "YarnScaling", "apply_rope", "rope_spec", "yarn_correction_range", "yarn_mscale"]
