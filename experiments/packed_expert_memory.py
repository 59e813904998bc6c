"""Compile-time memory of one MoE layer's routed experts run from MXFP4 bytes vs dequantize-then-matmul, on XLA:CPU.

K3's latent expert shapes (w1/w3: latent P = 3584 → hidden F = 3072, w2: F → P), 16 local experts, 256 tokens, top-k
16 (K3's top-k; every token picks all 16 local experts, so each expert gets 256 rows), bf16 activations. Both paths
are compiled from ShapeDtypeStructs (nothing allocated or run) and XLA's ``temp_size_in_bytes`` is read:

  packed     ``experts_sorted_packed`` on CPU: the (expert, F-chunk) loop decoding ≤ 512 columns of F at a time
  dequant    unpack the three stacks to bf16, then ``experts_sorted`` (the model's default dispatch; tiled on CPU)

for the forward pass and for forward + gradient w.r.t. the rows z (experts frozen). ``bf16_stack_bytes`` =
E · 3 · P · F · 2 B, the high-precision copy the packed path must not build.

    .venv/bin/python experiments/packed_expert_memory.py            # prints JSON (compiles only: 7 s on 2 CPU cores)
    .venv/bin/python experiments/packed_expert_memory.py --small    # the shapes of the default-suite test
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import jax
import jax.numpy as jnp

from k3jax.ops.activations import glu_activation
from k3jax.ops.grouped_matmul import experts_sorted
from k3jax.ops.packed_experts import PackedWeight, dequantize_stack, experts_sorted_packed

K3_SHAPES = dict(experts=16, latent=3584, hidden=3072, tokens=256, top_k=16)
SMALL_SHAPES = dict(experts=16, latent=512, hidden=384, tokens=32, top_k=16)


def _temp_bytes(fn, *args) -> int:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def memory_figures(*, experts: int, latent: int, hidden: int, tokens: int, top_k: int, dtype=jnp.bfloat16,
                   with_grad: bool = True) -> dict:
    """XLA:CPU temp bytes of the packed and the dequantize-then-matmul expert paths (forward, and with ``with_grad``
    forward + dz)."""
    E, P, F, M, A = experts, latent, hidden, tokens, top_k
    act = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
    u8 = jnp.uint8
    sds = jax.ShapeDtypeStruct
    z = sds((M, P), dtype)
    ids = sds((M, A), jnp.int32)
    wts = sds((M, A), jnp.float32)
    w13 = (sds((E, F, P // 2), u8), sds((E, F, P // 32), u8))
    w2 = (sds((E, P, F // 2), u8), sds((E, P, F // 32), u8))
    stacks = (*w13, *w13, *w2)

    def packed(z, ids, wts, *w):
        return experts_sorted_packed(z, ids, wts, *w, act)

    def dequant(z, ids, wts, *w):
        dense = [dequantize_stack(PackedWeight(w[i], w[i + 1]), dtype) for i in (0, 2, 4)]
        return experts_sorted(z, ids, wts, *dense, act)

    def with_dz(fn):
        return jax.value_and_grad(lambda z, *a: jnp.sum(fn(z, *a).astype(jnp.float32)))

    t0 = time.perf_counter()
    out = {
        "shapes": dict(E=E, P=P, F=F, tokens=M, top_k=A, dtype=jnp.dtype(dtype).name),
        "bf16_stack_bytes": E * 3 * P * F * 2,
        "packed_stack_bytes": sum(s.size for s in stacks),
        "packed_temp_bytes": _temp_bytes(packed, z, ids, wts, *stacks),
        "dequant_temp_bytes": _temp_bytes(dequant, z, ids, wts, *stacks),
    }
    if with_grad:
        out["packed_fwd_dz_temp_bytes"] = _temp_bytes(with_dz(packed), z, ids, wts, *stacks)
        out["dequant_fwd_dz_temp_bytes"] = _temp_bytes(with_dz(dequant), z, ids, wts, *stacks)
    out["packed_temp_over_bf16_stack"] = out["packed_temp_bytes"] / out["bf16_stack_bytes"]
    out["dequant_temp_over_bf16_stack"] = out["dequant_temp_bytes"] / out["bf16_stack_bytes"]
    out["compile_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the default-suite test's shapes")
    args = ap.parse_args()
    print(json.dumps(memory_figures(**(SMALL_SHAPES if args.small else K3_SHAPES)), indent=2))


if __name__ == "__main__":
    main()
