"""Scalar float64 oracle for the MX formats (docs/numerics.md §10.1-§10.3), written as plain Python loops over blocks.

Independent of k3jax/ops/mx.py: exponents come from ``math.frexp`` on exact float64 values, elements are rounded by
searching the full list of representable magnitudes (built from the bit definitions), ties go to the even code
(mantissa bit 0), and the E8M0 scale is ``math.ldexp(1, b - 127)``. Slow; use it on small arrays only.

Shared conventions with the fast path (docs/numerics.md §10.2 and the module docstring of k3jax.ops.mx): inputs are
float32 values; float32 subnormals count as zero; an all-zero block has scale byte 0; a block with NaN/Inf has scale
byte 0xFF and zero element codes. The E2M1 code's sign bit is (x < 0) of the input, so -0.0 is code 0x0 and any
negative value that rounds to zero (a subnormal one too) is 0x8, as compressed-tensors writes them.
"""

from __future__ import annotations

import math

import numpy as np

BLOCK = 32
EMAX = {"e2m1": 2, "e4m3": 8, "e5m2": 15}
F32_MIN_NORMAL = 2.0**-126


def _magnitudes(fmt: str) -> list[tuple[float, int]]:
    """(value, code-without-sign) for every finite non-negative element of ``fmt``, from the bit layout."""
    exp_bits, man_bits, bias = {"e2m1": (2, 1, 1), "e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}[fmt]
    out = []
    for code in range(1 << (exp_bits + man_bits)):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        if fmt == "e4m3" and e == 15 and m == 7:
            continue  # S.1111.111 is NaN
        if fmt == "e5m2" and e == 31:
            continue  # Inf / NaN
        if e == 0:
            val = m / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            val = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        out.append((val, code))
    return out


_MAGS = {fmt: _magnitudes(fmt) for fmt in EMAX}
MAX_VALUE = {fmt: max(v for v, _ in mags) for fmt, mags in _MAGS.items()}
E2M1_VALUES = [v for v, _ in _MAGS["e2m1"]] + [-v for v, _ in _MAGS["e2m1"]]


def f32(x: float) -> float:
    """Round a float64 to the nearest float32 value."""
    return float(np.float32(x))


def round_to_grid(v: float, fmt: str, negative: bool | None = None) -> tuple[float, int]:
    """Round-to-nearest-even of float64 ``v`` onto ``fmt``'s grid, saturating at +-max. Returns (value, code).

    The code's sign bit is ``negative`` when given, else the sign bit of ``v`` (so -0.0 is negative)."""
    sign = math.copysign(1.0, v) < 0 if negative is None else negative
    a = min(abs(v), MAX_VALUE[fmt])
    best = None
    for val, code in _MAGS[fmt]:
        d = abs(a - val)
        # Strictly closer wins; on a tie, the even code (mantissa lsb 0) wins.
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0 and best[2] % 2 == 1):
            best = (d, val, code)
    _, val, code = best
    width = {"e2m1": 4, "e4m3": 8, "e5m2": 8}[fmt]
    return (-val if sign else val), code | (int(sign) << (width - 1))


def scale_byte(amax: float, fmt: str = "e2m1", rule: str = "even") -> int:
    """E8M0 byte for a block with float32 max-abs ``amax`` (already flushed: 0 or >= 2^-126)."""
    if math.isnan(amax) or math.isinf(amax):
        return 0xFF
    if amax == 0.0:
        return 0
    emax = EMAX[fmt]
    m, e = math.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)
    E = e - 1  # amax = (2m) * 2^E, 2m in [1, 2)
    if rule == "floor":
        b = E + 127 - emax
    elif rule == "even":
        # round_pow2: round amax up to 2^(E+1) iff its significand is >= 1.75 (adding 0x200000 carries).
        b = E + (1 if 2 * m >= 1.75 else 0) + 127 - emax
    elif rule == "ceil":
        t = f32(amax / MAX_VALUE[fmt])  # the rule is defined on the float32 quotient
        if t < F32_MIN_NORMAL:
            b = 1  # a subnormal quotient rounds up to the smallest normal power of two
        else:
            mt, et = math.frexp(t)
            b = (et - 1 if mt == 0.5 else et) + 127
    else:
        raise ValueError(rule)
    return min(max(b, 0), 254)


def e8m0_value(b: int) -> float:
    return math.nan if b == 0xFF else math.ldexp(1.0, b - 127)


def quantize_row(row, fmt: str = "e2m1", rule: str = "even") -> tuple[list[int], list[int]]:
    """One 1-D row (length a multiple of 32) -> (element codes, scale bytes), block by block."""
    vals = [f32(float(x)) for x in row]
    # E2M1 sign bit = (x < 0) of the input (compressed-tensors: -0.0 -> 0x0, a negative that rounds to 0 -> 0x8,
    # docs/numerics.md §10.2); the float8 formats keep the sign bit of the (flushed) value, as a float8 cast does.
    negative = [x < 0 for x in vals] if fmt == "e2m1" else [None] * len(vals)
    vals = [math.copysign(0.0, x) if (abs(x) < F32_MIN_NORMAL) else x for x in vals]  # flush float32 subnormals
    codes, scales = [], []
    for g in range(0, len(vals), BLOCK):
        block = vals[g:g + BLOCK]
        amax = max((abs(x) for x in block), default=0.0)
        if any(math.isnan(x) for x in block):
            amax = math.nan
        b = scale_byte(amax, fmt, rule)
        scales.append(b)
        if b == 0xFF:
            codes.extend([0] * len(block))
            continue
        s = e8m0_value(b)
        codes.extend(round_to_grid(x / s, fmt, neg)[1] for x, neg in zip(block, negative[g:g + BLOCK], strict=True))
    return codes, scales


def element_value(code: int, fmt: str) -> float:
    width = {"e2m1": 4, "e4m3": 8, "e5m2": 8}[fmt]
    mag = dict((c, v) for v, c in _MAGS[fmt])
    if (code & ((1 << (width - 1)) - 1)) not in mag:
        return math.nan
    v = mag[code & ((1 << (width - 1)) - 1)]
    return -v if code >> (width - 1) else v


def dequantize_row(codes, scales, fmt: str = "e2m1") -> list[float]:
    return [element_value(int(c), fmt) * e8m0_value(int(scales[i // BLOCK])) for i, c in enumerate(codes)]


def quantize(x, fmt: str = "e2m1", rule: str = "even") -> tuple[np.ndarray, np.ndarray]:
    """[..., n] array -> (codes uint8 [..., n], scales uint8 [..., n/32]); blocks along the last axis."""
    x = np.asarray(x, dtype=np.float64)
    flat = x.reshape(-1, x.shape[-1])
    out = [quantize_row(r, fmt, rule) for r in flat]
    codes = np.array([c for c, _ in out], dtype=np.uint8).reshape(x.shape)
    scales = np.array([s for _, s in out], dtype=np.uint8).reshape(*x.shape[:-1], x.shape[-1] // BLOCK)
    return codes, scales


def dequantize(codes, scales, fmt: str = "e2m1") -> np.ndarray:
    """Inverse of ``quantize`` in float64."""
    codes, scales = np.asarray(codes), np.asarray(scales)
    fc, fs = codes.reshape(-1, codes.shape[-1]), scales.reshape(-1, scales.shape[-1])
    return np.array([dequantize_row(c, s, fmt) for c, s in zip(fc, fs)], dtype=np.float64).reshape(codes.shape)


def pack_row(codes) -> list[int]:
    """compressed-tensors packing: byte j = code[2j] | code[2j+1] << 4 (low nibble = even column)."""
    return [int(codes[2 * j]) | (int(codes[2 * j + 1]) << 4) for j in range(len(codes) // 2)]
