"""Test helpers: relative-RMS comparison (docs/numerics.md §15.1), tolerance table, tiny inputs.

rel_rms(x, ref) = ||x - ref||_2 / ||ref||_2, computed in float64 on host. A comparison passes if
max|x - ref| <= atol_floor or rel_rms <= ratio; both numbers are reported on failure. NaN/Inf always fail.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from k3jax.model import abstract_params

# Tolerances by comparison; change only in review (docs/design.md §3.3).
TOL = {
    "fp32_vs_fp64": 1e-5,
    "fp64_vs_fp64": 1e-12,
    "fp32_grad": 1e-4,
    "bf16": 1e-2,
    "situ": 1e-6,
    "attn_res": 1e-6,
    # float64 gradients of two float64 paths (e.g. sorted vs dense expert dispatch): rounding order only, summed
    # through the whole backward pass; the floor covers leaves whose gradient is ~0 (relative error undefined).
    "fp64_grad": 1e-10,
    "fp64_grad_floor": 1e-15,
    # fp32 a few roundings deep (norms, expert dispatch / EP forward, losses) vs fp64 or reordered fp32: seen <= 2e-7
    "fp32_shallow": 1e-6,
    # fp32 gradients of one training step on a device mesh (sharded reductions, expert-parallel dispatch) vs one
    # device: the mesh issue's bound, per leaf
    "fp32_mesh_vs_single": 1e-5,
}


def rel_rms(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((x - ref).ravel())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / den)


def assert_close(x, ref, ratio: float, *, atol_floor: float = 0.0, name: str = "value") -> float:
    """Assert rel_rms(x, ref) <= ratio (or max-abs <= atol_floor). Returns the rel_rms."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        raise AssertionError(f"{name}: shape {x.shape} != reference shape {ref.shape}")
    if not np.all(np.isfinite(x)):
        raise AssertionError(f"{name}: {np.sum(~np.isfinite(x))} non-finite entries")
    if not np.all(np.isfinite(ref)):
        raise AssertionError(f"{name}: reference has {np.sum(~np.isfinite(ref))} non-finite entries")
    err = rel_rms(x, ref)
    max_abs = float(np.max(np.abs(x - ref))) if x.size else 0.0
    if not (err <= ratio or max_abs <= atol_floor):
        raise AssertionError(f"{name}: rel_rms {err:.3e} > {ratio:.1e} (max-abs {max_abs:.3e}, floor {atol_floor:.1e})")
    return err


def assert_same_greedy(tokens, logits, ref_tokens, ref_logits, *, margin: float = 1e-3, logits_tol: float = 1e-5,
                       min_share: float = 0.9) -> int:
    """Greedy decoding by another route (speculative, pieces) against a reference run: tokens [B, N] identical
    wherever the reference's top-2 logit margin exceeds ``margin`` — at a near-tie the two may pick differently,
    and a row's comparison ends where they do — and the logits behind each compared token within ``logits_tol``
    rel-RMS. Rows that stopped (-1) end there. Returns the tokens compared; at least ``min_share`` of all must be."""
    tokens, ref_tokens = np.asarray(tokens), np.asarray(ref_tokens)
    compared = 0
    for b in range(ref_tokens.shape[0]):
        for t in range(ref_tokens.shape[1]):
            if ref_tokens[b, t] < 0:
                assert tokens[b, t] < 0, f"row {b} step {t}: the reference stopped, this run did not"
                break
            err = rel_rms(logits[b, t], ref_logits[b, t])
            assert err <= logits_tol, f"row {b} step {t}: logits rel-RMS {err:.2e} > {logits_tol:.0e}"
            top2 = np.sort(np.asarray(ref_logits[b, t], np.float64))[-2:]
            if tokens[b, t] != ref_tokens[b, t]:
                assert top2[1] - top2[0] <= margin, (f"row {b} step {t}: token {tokens[b, t]} != {ref_tokens[b, t]} "
                                                     f"at a top-2 margin of {top2[1] - top2[0]:.2e}")
                break                                    # a near-tie flipped: the rows part from here
            compared += 1
    assert compared >= min_share * ref_tokens.size, f"only {compared} of {ref_tokens.size} tokens compared"
    return compared


def block(cls, key, **kw):
    """``(params dict, apply)`` for an NNX block: tests drive blocks functionally, editing the dict freely.

        p, moe = block(MoE, jax.random.key(0), d=24, num_experts=8, ...)
        y, routing = moe(p, x, top_k=3, act="situ")      # nnx.merge(graphdef, p)(x, ...)
    """
    from flax import nnx

    gdef, state = nnx.split(cls(**kw, rngs=nnx.Rngs(params=key)))
    return state.to_pure_dict(), lambda p, *a, **k: nnx.merge(gdef, p)(*a, **k)


def jaxpr_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its equations' parameters (shard_map, custom_vjp, pjit
    bodies), depth first."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in v if isinstance(v, list | tuple) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner)


def random_params(cfg, seed: int = 0, std: float = 0.02):
    """Random parameters of ``cfg``'s shapes and dtypes from NumPy (no jax PRNG compile): fixtures for I/O tests."""
    import jax

    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (std * rng.standard_normal(s.shape)).astype(s.dtype), abstract_params(cfg))


def job_env(cache, root) -> dict:
    """The environment of each process a multi-process test starts (scripts/multiprocess.sh or by hand): the CPU,
    no device count chosen (`k3` starts mesh / processes devices in each), the caller's other XLA options (the
    suite's -O0), ``cache`` as the compilation cache of the single-process runs (a CPU job turns it off), and the
    checkout ``root`` on the path."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
               PYTHON=sys.executable, PYTHONPATH=str(root))
    return env


def free_port() -> int:
    """A free localhost TCP port (for a local ``jax.distributed`` coordinator in multi-process tests)."""
    import socket

    with socket.socket() as sk:
        sk.bind(("localhost", 0))
        return sk.getsockname()[1]


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """``lax.ragged_all_to_all`` (which XLA:CPU cannot run) written from its documented semantics with a padded
    all_to_all, one slice per peer, for CPU tests of the GPU/TPU expert exchange: chunk i =
    operand[input_offsets[i] : + send_sizes[i]] lands at output_offsets[i] of peer i."""
    import jax
    import jax.numpy as jnp

    n = operand.shape[0]
    c = jnp.arange(n)
    valid = c[None, :] < send_sizes[:, None]  # [X, n]
    src = jnp.clip(input_offsets[:, None] + c[None, :], 0, n - 1)
    mask = valid.reshape(valid.shape + (1,) * (operand.ndim - 1))
    chunks = jnp.where(mask, operand[src], jnp.zeros((), operand.dtype))
    recv = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
    off = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    pos = jnp.where(c[None, :] < recv_sizes[:, None], off[:, None] + c[None, :], output.shape[0])
    return output.at[pos.reshape(-1)].set(recv.reshape((-1,) + operand.shape[1:]), mode="drop")
