"""HBM bytes of small data-movement programs at K3's expert-row shapes, compiled for one v5p chip by the deviceless
TPU compiler and read by ``k3jax.plan.hlo_cost.program_stats`` (the plan's own byte reader): which forms of the
MXFP8 fake-quant, the even / odd column split after the row padding, and the column interleave XLA:TPU runs without
relayout copies. Used for the packed-expert FFN choices in experiments/LOG.md (2026-12-05, session 21); the
``qat_ffn_*`` cases (the QAT experts' grouped FFN by ``lax.ragged_dot`` over one chip's rows, its forward or forward
+ backward, h's quant unfused, fused by pallas_kernels/glu_quant, or absent) for session 29's.

    JAX_PLATFORMS=cpu .venv/bin/python experiments/tpu_layout_bytes.py            # every case
    JAX_PLATFORMS=cpu .venv/bin/python experiments/tpu_layout_bytes.py split_strided_clip interleave_pad

Needs libtpu (one libtpu process at a time: not beside a `k3 plan --compile` or the test suite). Shapes: the
v5p-512 frozen plan's per-chip receive buffer, R = 81,920 rows of P = 3,584 (bf16), padded to 85,760 rows; h is
[85,760, F = 3,072]. "ideal" is one read of each input and one write of each output.
"""

from __future__ import annotations

import sys
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops import fp32_bits, mx
from k3jax.ops.activations import glu_activation, glu_hidden
from k3jax.plan.hlo_cost import program_stats
from pallas_kernels.glu_quant import glu_mxfp8

R, P, RP, F, EL = 81920, 3584, 85760, 3072, 14
BF16 = jnp.bfloat16
ACT = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)


def _f8_qdq(x, amax):
    """MXFP8 qdq by native float8 converts from a block max [R, G] (a repeat of the block exponent per element)."""
    b = jnp.repeat(mx.scale_bytes(amax, fmt="e4m3", rule="ceil").astype(jnp.int32), 32, axis=1)
    v = x.astype(jnp.float32) * fp32_bits.pow2_f32((127 - b) // 2) * fp32_bits.pow2_f32(127 - b - (127 - b) // 2)
    q = jnp.clip(v, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    e = b - 127
    return (q * fp32_bits.pow2_f32(e // 2) * fp32_bits.pow2_f32(e - e // 2)).astype(x.dtype)


def _flat_quant(x):
    """The MXFP8 quantize step of ``mx._quantize_blocks`` on the flat [R, P] layout: the block max by
    ``lax.reduce_window`` and a repeat of the scale byte instead of the [R, G, 32] view."""
    x32 = fp32_bits.flush_subnormals(x.astype(jnp.float32))
    amax = lax.reduce_window(jnp.abs(x32), -jnp.inf, lax.max, (1, 32), (1, 32), "VALID")
    b = jnp.repeat(mx.scale_bytes(amax, fmt="e4m3", rule="ceil"), 32, axis=1)
    finite = b != 255
    v = fp32_bits.scale_by_pow2(jnp.where(finite, x32, 0.0), 127 - jnp.where(finite, b.astype(jnp.int32), 127))
    return jnp.clip(v, -448.0, 448.0).astype(jnp.float8_e4m3fn)


def _pad_interleave(a, b):
    z = jnp.zeros((), a.dtype)
    return lax.pad(a, z, [(0, 0, 0), (0, 1, 1)]) + lax.pad(b, z, [(0, 0, 0), (1, 0, 1)])


def _qat_ffn(quant: str | None, backward: bool):
    """The QAT experts' grouped FFN (``ops.grouped_matmul``'s ragged path: three ``lax.ragged_dot`` around
    ``glu_hidden``) over R rows sorted into 14 local experts (v5p-512's fsdp 8 x expert 64): <y, dy>, or its
    gradients with respect to the rows and the three stacks; h's MXFP8 quant unfused ("xla"), fused ("kernel"), or
    none."""
    fused = lambda *a, **k: glu_mxfp8(*a, **k, platform="tpu")  # noqa: E731
    aq = {None: None, "xla": mx.ActQuant(), "kernel": mx.ActQuant(glu=fused)}[quant]

    def f(xs, gs, w1, w3, w2, dy):
        a = lax.ragged_dot(xs, w1, gs, preferred_element_type=jnp.float32)
        b = lax.ragged_dot(xs, w3, gs, preferred_element_type=jnp.float32)
        y = lax.ragged_dot(glu_hidden(a, b, ACT, BF16, act_quant=aq), w2, gs, preferred_element_type=jnp.float32)
        return jnp.vdot(y, dy.astype(y.dtype))

    return jax.grad(f, argnums=(0, 2, 3, 4)) if backward else f


X, IDX_P, HALF, IDX_R, HID = (R, P), (RP,), (RP, P // 2), (R,), (RP, F)
QAT = [X, (EL,), (EL, P, F), (EL, P, F), (EL, F, P), X]  # rows, group sizes, w1, w3, w2, dy
CASES = {  # name: (function, input shapes (int32 for index vectors, else bf16), ideal bytes; 0: not stated)
    "quant_fake_quant_mxfp8": (lambda x: mx.fake_quant_mxfp8(x, axis=-1), [X], 2 * R * P * 2),
    "quant_only_reduce_window": (_flat_quant, [X], R * P * 3),  # quantize only: float8 out, no dequantize
    "quant_f8_reshape_max": (lambda x: _f8_qdq(x, jnp.max(jnp.abs(x).reshape(R, P // 32, 32), -1)
                                               .astype(jnp.float32)), [X], 2 * R * P * 2),
    "quant_f8_reduce_window": (lambda x: _f8_qdq(x, lax.reduce_window(
        jnp.abs(x), jnp.array(0, BF16), lax.max, (1, 32), (1, 32), "VALID").astype(jnp.float32)), [X], 2 * R * P * 2),
    "split_reshape_fill": (lambda x, i: (lambda y2: (y2[..., 0], y2[..., 1]))(
        jnp.take(x, i, axis=0, mode="fill", fill_value=0).reshape(RP, P // 2, 2)), [X, IDX_P], (R + RP) * P * 2),
    "split_strided_fill": (lambda x, i: (lambda y: (y[:, 0::2], y[:, 1::2]))(
        jnp.take(x, i, axis=0, mode="fill", fill_value=0)), [X, IDX_P], (R + RP) * P * 2),
    "split_strided_clip": (lambda x, i: (lambda y: (y[:, 0::2], y[:, 1::2]))(
        jnp.take(x, i, axis=0, mode="clip")), [X, IDX_P], (R + RP) * P * 2),
    "interleave_stack": (lambda a, b, i: jnp.stack([a[i], b[i]], -1).reshape(R, P), [HALF, HALF, IDX_R],
                         (RP + R) * P * 2),
    "interleave_pad": (lambda a, b, i: _pad_interleave(a[i], b[i]), [HALF, HALF, IDX_R], (RP + R) * P * 2),
    "h_act_split": (lambda a, b: (lambda h: (h[:, 0::2], h[:, 1::2]))(ACT(a.astype(jnp.float32),
                                                                          b.astype(jnp.float32)).astype(BF16)),
                    [HID, HID], 3 * RP * F * 2),
    "h_act_quant_split": (lambda a, b: (lambda h: (h[:, 0::2], h[:, 1::2]))(mx.fake_quant_mxfp8(
        ACT(a.astype(jnp.float32), b.astype(jnp.float32)).astype(BF16), axis=-1)), [HID, HID], 3 * RP * F * 2),
    **{f"qat_ffn_{part}_{q or 'noquant'}": (_qat_ffn(q, part == "fwdbwd"), QAT, 0)
       for part in ("fwd", "fwdbwd") for q in (None, "xla", "kernel")},
}


def main(names: list[str]) -> None:
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    dev = list(topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices)[:1]
    mesh = Mesh(dev, ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())
    for name in names or list(CASES):
        fn, shapes, ideal = CASES[name]
        args = [jax.ShapeDtypeStruct(s, jnp.int32 if len(s) == 1 else BF16, sharding=sharding) for s in shapes]
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # Mosaic reads the TPU version from it
            stats = program_stats(jax.jit(fn).lower(*args).compile().as_text())
        note = f"   (ideal {ideal / 1e9:.2f} GB)" if ideal else ""
        print(f"{name:28s} {stats.bytes_accessed / 1e9:6.2f} GB{note}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
