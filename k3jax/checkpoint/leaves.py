"""The loader's output leaves: which arrays a load produces, how each is read for a device, where it is placed.

    leaves = output_leaves(plan, abstract_params(cfg), keep_experts_packed, cfg)   # [OutLeaf]
    src = LeafSource(ck, plan, source_path(row, kind), shape, dtype, kind)   # one per-layer-view row
    host = src(index)                                                        # host values of one device's index

A leaf of the stacked layer groups (k3jax/model/layout.py) is G per-layer rows under a leading [G] axis;
``StackedSource`` reads each row with its own ``LeafSource``.

Kinds: ``dense`` (one checkpoint tensor, transformed by the name map), ``expert`` (BF16 experts, one tensor each),
``mxfp4`` (packed experts dequantized), ``packed`` / ``scale`` (packed experts kept as stored, uint8).

Default placement (``default_sharding``): routed-expert stacks split on the mesh axis "expert" (when it divides the
expert count), every other leaf replicated; the default mesh is ``make_mesh({"expert": device_count})``.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.container import SAFETENSORS_DTYPES, TensorEntry
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.host import Scratch, aligned_empty, host_transpose
from k3jax.checkpoint.io import Checkpoint
from k3jax.checkpoint.plan import Plan
from k3jax.errors import InputError
from k3jax.layers.experts import PACKED_PARTS, packed_name, parse_packed_name
from k3jax.model import layout
from k3jax.pytree import key_names
from k3jax.quant.host import mxfp4_dequantize_T_into
from k3jax.sharding.mesh import make_mesh

_SAME_SIZE_TRANSFORMS = ("copy", "row", "conv", "flat", "a_log_4d")  # a reshape at most: bytes copied as they are


def _norm_index(index, shape) -> tuple:
    return tuple((s.indices(n)[:2]) if isinstance(s, slice) else (s, s + 1) for s, n in zip(index, shape,
                                                                                            strict=False))


class LeafSource:
    """Reads the host values of one output leaf, for any device index; memoized per index.

    Every result is a fresh ``ALIGN``-aligned C-contiguous array (for a full index), so on the CPU backend
    ``make_array_from_callback`` adopts it without copying, and replicas of one index share one host buffer.
    Packed experts and same-dtype tensors are read with positional reads straight into that buffer (one copy, as a
    plain ``read()``); linear weights and BF16 experts are read as stored and transposed (and cast) in one XLA pass
    on the host CPU (``host_transpose``); MXFP4 experts are dequantized out of the mapped file into the buffer.
    ``seconds`` sums the time spent here (read + decode).
    """

    def __init__(self, ck: Checkpoint, plan: Plan, path: tuple, shape: tuple, dtype, kind: str,
                 scratch: Scratch | None = None):
        self.ck, self.path, self.shape, self.dtype, self.kind = ck, path, tuple(shape), np.dtype(dtype), kind
        self.scratch = scratch if scratch is not None else Scratch()
        self.pairs = plan.leaves[path]  # [(spec, entry)]
        self.cache: dict[tuple, np.ndarray] = {}
        self.seconds = 0.0

    def __call__(self, index) -> np.ndarray:
        key = _norm_index(index, self.shape)
        if key not in self.cache:
            t = time.perf_counter()
            self.cache[key] = self._read(index)
            self.seconds += time.perf_counter() - t
        return self.cache[key]

    def _read(self, index) -> np.ndarray:
        if self.kind == "dense":
            if "full" not in self.cache:
                self.cache["full"] = self._dense()
            return self.cache["full"][tuple(index)]
        ids = range(self.shape[0])[index[0]] if isinstance(index[0], slice) else [index[0]]
        out = self._experts(ids)
        rest = tuple(index[1:])
        return out[(slice(None), *rest)] if any(r != slice(None) for r in rest) else out

    def _part(self, part: str) -> list[TensorEntry]:
        """The entries of one part ("packed" / "scale"), in expert order."""
        return [e for s, e in self.pairs if s.part == part]

    # -- expert stacks: [len(ids), ...] for expert ids ``ids``
    def _experts(self, ids) -> np.ndarray:
        if self.kind in ("packed", "scale"):
            return self._stored_experts(ids)
        if self.kind == "mxfp4":
            return self._mxfp4_experts(ids)
        return self._bf16_experts(ids)

    def _stored_experts(self, ids) -> np.ndarray:
        """Kept packed: [E, out, in/2] or [E, out, in/32], the on-disk bytes."""
        out = aligned_empty((len(ids), *self.shape[1:]), self.dtype)
        es = self._part(self.kind)
        for j, i in enumerate(ids):
            self.ck.read_into(es[i], out[j])
        return out

    def _mxfp4_experts(self, ids) -> np.ndarray:
        """Dense [E, in, out] from packed [out, in/2] + scale [out, in/32], decoded out of the mapped file."""
        out = aligned_empty((len(ids), *self.shape[1:]), self.dtype)
        pk, sc = self._part("packed"), self._part("scale")
        for j, i in enumerate(ids):
            mxfp4_dequantize_T_into(out[j], self.ck.view_entry(pk[i]), self.ck.view_entry(sc[i]))
        return out

    def _bf16_experts(self, ids) -> np.ndarray:
        """BF16 torch [out, in] per expert, read as stored, then one transpose for all."""
        ents = [e for _, e in self.pairs]
        dts = {ents[i].dtype for i in ids}
        if len(dts) == 1:
            common = SAFETENSORS_DTYPES[next(iter(dts))]
        else:
            common = np.dtype(np.float64 if "F64" in dts else np.float32)
        raw = self.scratch.take((len(ids), *ents[0].shape), common)
        for j, i in enumerate(ids):
            if len(dts) == 1:
                self.ck.read_into(ents[i], raw[j])
            else:  # experts of one layer stored in different float dtypes: widen to a common one first
                np.copyto(raw[j], self.ck.view_entry(ents[i]), casting="unsafe")
        return host_transpose(raw, self.dtype)

    # -- one checkpoint tensor
    def _dense(self) -> np.ndarray:
        (spec, entry), = self.pairs
        src_dtype = SAFETENSORS_DTYPES[entry.dtype]
        if spec.transform == "linear":  # leaf [*in, *out] ← torch [prod(out), prod(in)]: as stored, one transpose
            raw = self.ck.read_into(entry, self.scratch.take(entry.shape, src_dtype))
            return host_transpose(raw, self.dtype).reshape(self.shape)
        out = aligned_empty(self.shape, self.dtype)
        if spec.transform in _SAME_SIZE_TRANSFORMS and math.prod(entry.shape) == out.size:
            if src_dtype == self.dtype:
                self.ck.read_into(entry, out)
            else:
                np.copyto(out.reshape(-1), self.ck.read_into(entry, aligned_empty(entry.shape, src_dtype)).reshape(-1),
                          casting="unsafe")
            return out
        # a_log_pad (checks the zero tail) and anything new: the name map's reference transform
        try:
            v = nm.leaf_from_hf(self.ck.view_entry(entry), spec, self.shape)
        except InputError as err:
            raise CheckpointError(str(err).removeprefix(f"{spec.name}: "), file=entry.file, tensor=spec.name) from None
        np.copyto(out, v, casting="unsafe")
        return out


class OutLeaf(NamedTuple):
    """One array a load produces. ``rows``: the per-layer-view paths (``name_map`` addresses) it is read from —
    one, or one per layer for a leaf of the stacked groups (``stacked``: a leading [G] axis over those layers)."""

    path: tuple  # state path (kept-packed parts: ``w1_packed`` / ``w1_scale``)
    shape: tuple
    dtype: object
    kind: str  # dense | expert | mxfp4 | packed | scale
    rows: tuple
    stacked: bool


def view_rows(path: tuple, cfg) -> tuple[tuple, ...]:
    """The per-layer-view paths a state leaf holds, in stack order (k3jax/model/layout.py)."""
    lay = layout(cfg)
    if path[0] == "groups":
        return tuple(("layers", l, *path[3:]) for l in lay.stacked_layers(path[2]))
    if path[0] in ("pre", "post"):
        return (("layers", getattr(lay, path[0])[path[1]], *path[2:]),)
    return (path,)


def output_leaves(plan: Plan, abstract, keep_experts_packed: bool, cfg) -> list[OutLeaf]:
    """Every output leaf, in tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for kp, sds in flat:
        path = key_names(kp)
        rows = view_rows(path, cfg)
        stacked = path[0] == "groups"
        lead = (len(rows),) if stacked else ()
        layer_shape = tuple(sds.shape)[len(lead):]
        view = rows[0]
        if view not in plan.leaves:
            raise CheckpointError(f"params leaf {'/'.join(map(str, view))} has no tensor in the checkpoint")
        if view in plan.packed and plan.packed[view] and keep_experts_packed:
            E = layer_shape[0]
            for part in PACKED_PARTS:
                s = next(s for s, _ in plan.leaves[view] if s.part == part)
                out.append(OutLeaf((*path[:-1], packed_name(path[-1], part)), (*lead, E, *s.shape), np.dtype(np.uint8),
                                   part, tuple((*r[:-1], f"{r[-1]}_{part}") for r in rows), stacked))
        else:
            kind = ("mxfp4" if plan.packed[view] else "expert") if view in plan.packed else "dense"
            out.append(OutLeaf(path, tuple(sds.shape), sds.dtype, kind, rows, stacked))
    return out


class StackedSource:
    """The host values of a stacked leaf [G, ...] for any device index: row g from the ``LeafSource`` of layer g
    (each row's host copy is dropped once copied into the stacked buffer)."""

    def __init__(self, rows: list[LeafSource]):
        self.rows = rows
        self.shape = (len(rows), *rows[0].shape)
        self.dtype = rows[0].dtype
        self.cache: dict[tuple, np.ndarray] = {}

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    def __call__(self, index) -> np.ndarray:
        key = _norm_index(index, self.shape)
        if key not in self.cache:
            gs = range(self.shape[0])[index[0]] if isinstance(index[0], slice) else [index[0]]
            rest = tuple(index[1:])
            out = None
            for j, g in enumerate(gs):
                part = self.rows[g](rest)
                if out is None:
                    out = aligned_empty((len(gs), *part.shape), self.dtype)
                out[j] = part
                self.rows[g].cache.clear()
            self.cache[key] = out
        return self.cache[key]


def source_path(path: tuple, kind: str) -> tuple:
    """The plan leaf an output leaf is read from: itself, or for a kept-packed part ``w1_packed`` its stack ``w1``."""
    return path if kind in ("dense", "mxfp4", "expert") else (*path[:-1], parse_packed_name(path[-1])[0])


def default_mesh() -> Mesh:
    """All devices on the "expert" axis (the other three axes of every k3jax mesh have size 1)."""
    return make_mesh({"expert": jax.device_count()})


def default_sharding(mesh: Mesh, kind: str, shape, stacked: bool = False) -> NamedSharding:
    """Routed-expert stacks on the "expert" axis when it divides E (behind the ``layers`` axis of a stacked leaf);
    everything else replicated."""
    e_dim = 1 if stacked else 0
    if kind != "dense" and "expert" in mesh.axis_names and shape[e_dim] % mesh.shape["expert"] == 0:
        return NamedSharding(mesh, PartitionSpec(*([None] * e_dim), "expert"))
    return NamedSharding(mesh, PartitionSpec())


__all__ = ["LeafSource", "OutLeaf", "StackedSource", "default_mesh", "default_sharding", "output_leaves",
           "source_path", "view_rows"]
