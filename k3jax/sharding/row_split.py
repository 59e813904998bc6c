"""Whole sequences per device: the MLA flash kernel under a row split (``--mesh fsdp=8,expert=64``, no context axis).

    rows = RowSplit(mesh, ("fsdp", "expert"))                 # rows over those axes, heads over ``head_axes``
    o, max_logit = rows.latent_flash(flash, q, c_kv, k_rope, w_uk, w_uv, segment_ids=seg)

A Pallas call (Mosaic on TPU, Triton on GPU) is not partitioned by the compiler: outside ``shard_map`` it runs on one
device. When the mesh splits only the batch (each device holds whole rows: training's token axes, no ``context``),
attention needs nothing from another device, so the kernel runs per device inside one ``shard_map``: each device
attends over its own rows, for the heads it holds (``heads`` under the rules: ``tensor``). The weights W_UK / W_UV
enter whole along R and split by head like q; their gradients are summed over the row axes by ``shard_map``'s
transpose (the kernel's backward marks them as not varying over the rows: ``match_varying``). The max logit is per
row and head, so no collective is needed. Under a context axis the sequence is split and the kernels run in
``ContextParallel`` instead (k3jax/sharding/context_parallel.py); the small-batch rule (every row on every device)
has no row split.

Why this matters: without it the plans' training steps ran MLA through XLA's blockwise attention, whose [N, T, bk]
fp32 score blocks go through HBM (~1.4 TB of the frozen-experts step's 28.5 TB per chip on v5p-512;
experiments/LOG.md). The KDA kernel is not run this way: its backward is the jnp chunked path's VJP and its forward
declares no cost estimate, so a plan would not count its bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.sharding.mesh import axis_sizes


def _spec(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


class RowSplit:
    """The rows of a batch split over ``row_axes`` of ``mesh`` (whole sequences per device), heads over
    ``head_axes``; carried by ``ExpertParallel.rows`` (module docstring)."""

    def __init__(self, mesh: jax.sharding.Mesh, row_axes: tuple[str, ...], head_axes: tuple[str, ...] = ()):
        sizes = axis_sizes(mesh)
        self.mesh = mesh
        self.row_axes = tuple(a for a in row_axes if sizes.get(a, 1) > 1)
        self.head_axes = tuple(a for a in head_axes if sizes.get(a, 1) > 1)

    def latent_flash(self, flash, q, c_kv, k_rope, w_uk, w_uv, *, segment_ids=None):
        """``flash(q, c_kv, k_rope, w_uk, w_uv[, segment_ids=])`` → (o, max_logit) run per device on its rows (e.g.
        ``layers.backends.mla_flash`` with its scale and block bound): q [B, T, N, Hn+Hr], c_kv [B, T, R], k_rope
        [B, T, Hr], w_uk [R, N, Hn], w_uv [R, N, V], segment_ids [B, T] or None. Returns (o [B, T, N, V], max logit
        [B, N]), split like q."""
        b, h = _spec(self.row_axes), _spec(self.head_axes)
        docs = segment_ids is not None

        def local(q, c, r, wk, wv, *seg):
            kw = dict(segment_ids=seg[0]) if docs else {}
            return flash(q, c, r, wk, wv, **kw)

        in_specs = (P(b, None, h, None), P(b, None, None), P(b, None, None), P(None, h, None), P(None, h, None))
        args = (q, c_kv, k_rope, w_uk, w_uv)
        if docs:
            in_specs, args = (*in_specs, P(b, None)), (*args, jnp.asarray(segment_ids, jnp.int32))
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=(P(b, None, h, None), P(b, h)))
        return fn(*args)


__all__ = ["RowSplit"]
