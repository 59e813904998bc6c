"""The scanned layer stack with AttnRes, its backward recomputing the block-sum buffer instead of saving it.

    carry, ys = scan_saving_parts(group, gparams, (part, buf), n_groups, committed)

``K3Model._scan_groups`` runs the repeating group as one ``lax.scan`` whose carry is the running block sum ``part``
[B, T, D] and the committed block sums ``buf`` [NB, B, T, D] (docs/model.md §3.3). Under ``remat="full"`` the plain way
is a scan of ``jax.checkpoint(group)``, whose backward keeps every group's inputs — the whole buffer once per group:
22 copies of f32 [8, 4096, 7168], 20.7 GB per chip of the full model's train step on v5p-512 (experiments/LOG.md).
Yet the buffer a group sees is the final buffer with the slots not yet committed still zero: a slot is written once,
at its commit, and the scan starts from zeros beyond the blocks committed before it. So this scan keeps only each
group's incoming ``part`` and the final buffer, and its backward (a ``jax.custom_vjp``) walks the groups in reverse,
rebuilds each group's buffer by masking the final one (bit for bit the buffer the forward saw), recomputes the group
under ``jax.vjp`` and carries the cotangents of ``part`` and ``buf`` — the arithmetic of the checkpointed scan's
backward, with one buffer saved.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _inexact(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def scan_saving_parts(group: Callable, gparams, carry0: tuple, n_groups: int, committed: Callable,
                      recompute: Callable | None = None):
    """``lax.scan`` of ``group(p, (part, buf), g) → ((part, buf), ys)`` over the stacked ``gparams`` and
    g = 0 … n_groups - 1 from ``carry0`` = (part, buf); ``committed(g)`` (traced g): the slots of ``buf`` filled
    when group g starts. Values and gradients as ``lax.scan`` of ``jax.checkpoint(group)``; saved for the
    backward: each group's incoming ``part`` and the final ``buf``. ``recompute``: the function of ``group``'s
    values the backward differentiates (default ``group``; the model passes one that checkpoints each layer, so
    that one layer's activations, not the group's, are live in a group's backward). Integer leaves of ``gparams``
    (frozen packed experts) get no cotangent; integer outputs in ``ys`` (routing ids) carry none."""
    recompute = group if recompute is None else recompute
    leaves, tdef = jax.tree.flatten(gparams)
    diff = [i for i, x in enumerate(leaves) if _inexact(x)]
    fixed = [i for i, x in enumerate(leaves) if not _inexact(x)]

    def params(d, f):
        out = [None] * len(leaves)
        for i, x in zip(diff, d):
            out[i] = x
        for i, x in zip(fixed, f):
            out[i] = x
        return jax.tree.unflatten(tdef, out)

    def forward(d, f, part, buf, save: bool):
        def body(carry, xs):
            dp, fp, g = xs
            new, ys = group(params(dp, fp), carry, g)
            return new, ((ys, carry[0]) if save else ys)
        return jax.lax.scan(body, (part, buf), (d, f, jnp.arange(n_groups)))

    @jax.custom_vjp
    def run(d, f, part, buf):
        return forward(d, f, part, buf, False)

    def run_fwd(d, f, part, buf):
        carry, (ys, parts) = forward(d, f, part, buf, True)
        return (carry, ys), (d, f, parts, carry[1])

    def run_bwd(res, cts):
        d, f, parts, buf_final = res
        (ct_part, ct_buf), ct_ys = cts
        ct_leaves = jax.tree.leaves(ct_ys)
        keep = [c.dtype != jax.dtypes.float0 for c in ct_leaves]
        slot = jnp.arange(buf_final.shape[0]).reshape((-1,) + (1,) * (buf_final.ndim - 1))

        def body(carry, xs):
            dp, fp, part_in, cy, g = xs
            buf_in = jnp.where(slot < committed(g), buf_final, jnp.zeros((), buf_final.dtype))

            def fn(dp, part, buf):
                new, ys = recompute(params(dp, fp), (part, buf), g)
                return new, [y for y, k in zip(jax.tree.leaves(ys), keep) if k]

            _, vjp = jax.vjp(fn, dp, part_in, buf_in)
            ct_dp, ct_part_in, ct_buf_in = vjp((carry, cy))
            return (ct_part_in, ct_buf_in), ct_dp

        cys = [c for c, k in zip(ct_leaves, keep) if k]
        (ct_part0, ct_buf0), ct_d = jax.lax.scan(body, (ct_part, ct_buf), (d, f, parts, cys, jnp.arange(n_groups)),
                                                  reverse=True)
        return ct_d, [None] * len(f), ct_part0, ct_buf0

    run.defvjp(run_fwd, run_bwd)
    return run([leaves[i] for i in diff], [leaves[i] for i in fixed], *carry0)


__all__ = ["scan_saving_parts"]
