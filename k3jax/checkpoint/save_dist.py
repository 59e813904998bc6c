"""Multi-process export (``jax.distributed``): every process writes only the tensors whose bytes it holds, into
one official-layout checkpoint on a filesystem all processes share — byte-identical to a single-process ``save``.

    save(params, cfg, "out/")      # in every process of a jax.distributed run; params sharded over the global mesh

Who writes a tensor: each checkpoint tensor is a region of one k3jax leaf — a whole leaf, one layer of a stacked
leaf, one routed expert of an expert stack (``name_map.TensorSpec``). Its writer is the lowest-numbered process
with a device whose shard of the leaf covers that region, read from the leaf's global sharding
(``devices_indices_map``), so every process agrees without communicating, and a tensor held on several processes
(a replicated leaf) is written once. A routed expert sharded over the expert axis is written by the process that
holds it, straight from its device shard (packed if it is held packed, or packed from that one expert's float
values: the MXFP4 scale is per 32-element block of one row, so packing one expert gives the bytes packing the stack
gives). A leaf whose regions no single device holds (e.g. one sharded over fsdp by rows of the torch layout) is
gathered first with ``multihost_utils.process_allgather`` — by every process in the same leaf order, since that is
a collective — and written by process 0.

Protocol (barriers: ``k3jax.distributed.barrier``): process 0 creates the temporary sibling directory and
every shard file at its final size with its header written (the header depends on names, dtypes and shapes only)
→ barrier → each process ``pwrite``s its tensors at their offsets → barrier → process 0 checks the sizes, writes the
index, config.json and the optional SHA256SUMS, and renames the directory into place → barrier. A process that fails
raises; the others then wait at the next barrier until the distributed runtime's own timeout.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
from jax.experimental import multihost_utils

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.safetensors_layout import shard_layout
from k3jax.distributed import any_process, barrier
from k3jax.layers.experts import holds_packed, packed_name, parse_packed_name
from k3jax.model import leaf_location
from k3jax.pytree import get_path
from k3jax.quant import pack_experts


def _covers(index: tuple, region: tuple, shape: tuple) -> bool:
    """Does the shard ``index`` (tuple of slices) contain ``region`` (ints for the leading axes, then whole axes)?"""
    for d, (sl, r) in enumerate(zip(index, region + (None,) * (len(shape) - len(region)))):
        start, stop, _ = sl.indices(shape[d])
        if r is None:
            if (start, stop) != (0, shape[d]):
                return False
        elif not start <= r < stop:
            return False
    return True


class _Pieces:
    """Host values of checkpoint tensors from the shards this process holds (``owner`` / ``get``)."""

    def __init__(self, params, cfg, rule: str = "even"):
        self.params, self.cfg, self.rule = params, cfg, rule  # rule: the MXFP4 scale rule of float expert stacks
        self.me = jax.process_index()
        self._gathered: dict[tuple, np.ndarray] = {}
        self._shards: dict[tuple, np.ndarray] = {}
        self._maps: dict[tuple, tuple] = {}  # (id(leaf), region rank) → (leaf, writer table, 'none' value)

    def gather_unheld(self, specs_by_file) -> None:
        """Collectively gather every leaf with a tensor region that no single device holds (same order everywhere)."""
        seen: set = set()
        for _, specs in specs_by_file:
            for s in specs:
                for spath, region in self._regions(s):
                    if spath in seen:
                        continue
                    seen.add(spath)
                    x = get_path(self.params, spath)
                    if not hasattr(x, "sharding") or self._writer(x, region) is not None:
                        continue
                    if x.is_fully_addressable and jax.process_count() == 1:
                        self._gathered[spath] = np.asarray(x)
                    elif x.is_fully_addressable:  # a process-local array in a multi-process run: no one writer
                        raise CheckpointError(f"leaf {'/'.join(map(str, spath))} lives on one process only and no "
                                              "device holds it whole; pass global arrays", tensor=s.name)
                    else:
                        self._gathered[spath] = np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def _regions(self, spec: nm.TensorSpec) -> list[tuple[tuple, tuple]]:
        """(state path, leading indices) of the leaf regions the tensor ``spec`` is made from."""
        spath, g = leaf_location(spec.path, self.cfg)
        lead = () if g is None else (g,)
        if spec.transform == "mxfp4":
            experts = get_path(self.params, leaf_location(spec.path[:-1], self.cfg)[0])
            w = spec.path[-1]
            if holds_packed(experts):
                base = leaf_location((*spec.path[:-1], packed_name(w, spec.part)), self.cfg)[0]
                return [(base, lead + (spec.expert,))]
            return [(spath, lead + (spec.expert,))]
        if spec.transform == "expert":
            return [(spath, lead + (spec.expert,))]
        return [(spath, lead)]

    def _writer(self, x, region) -> int | None:
        """The lowest process with a device holding ``region`` of ``x`` whole, or None. One table per leaf and
        region rank (full K3: ~10^5 expert tensors over a few hundred leaves, a few hundred devices each)."""
        shape, n = tuple(x.shape), len(region)
        key = (id(x), n)
        if key not in self._maps:
            none = np.iinfo(np.int32).max
            table = np.full(shape[:n], none, np.int32)
            for d, idx in x.sharding.devices_indices_map(shape).items():
                if all(sl.indices(shape[k])[:2] == (0, shape[k]) for k, sl in enumerate(idx) if k >= n):
                    table[idx[:n]] = np.minimum(table[idx[:n]], d.process_index)
            self._maps[key] = (x, table, none)  # the leaf kept so that its id stays valid
        _, table, none = self._maps[key]
        w = int(table[region])
        return None if w == none else w

    def owner(self, spec: nm.TensorSpec) -> int:
        spath, region = self._regions(spec)[0]
        if spath in self._gathered:
            return 0
        x = get_path(self.params, spath)
        if not hasattr(x, "sharding"):
            return 0  # a host (numpy) leaf: the same in every process
        w = self._writer(x, region)
        if w is None:
            raise CheckpointError(f"no device holds leaf {'/'.join(map(str, spath))} region {region} whole "
                                  "(internal: it should have been gathered)", tensor=spec.name)
        return w

    def _piece(self, spath: tuple, region: tuple) -> np.ndarray:
        """Leaf ``spath`` at ``region`` (leading indices dropped) from a local shard holding it."""
        if spath in self._gathered:
            return self._gathered[spath][region]
        x = get_path(self.params, spath)
        if not hasattr(x, "addressable_shards"):
            return np.asarray(x)[region]
        shape = tuple(x.shape)
        for k, s in enumerate(x.addressable_shards):
            if _covers(s.index, region, shape):
                key = (spath, k)
                if key not in self._shards:
                    self._shards[key] = np.asarray(s.data)
                local = tuple(r - sl.indices(shape[d])[0] for d, (r, sl) in enumerate(zip(region, s.index)))
                return self._shards[key][local]
        raise CheckpointError(f"process {self.me} holds no shard of {'/'.join(map(str, spath))} covering "
                              f"{region}")

    def get(self, spec: nm.TensorSpec) -> np.ndarray:
        (spath, region), = self._regions(spec)
        a = self._piece(spath, region)
        if spec.transform == "mxfp4":
            if parse_packed_name(spath[-1]):
                return np.asarray(a, np.uint8)
            p, s = pack_experts(a[None], rule=self.rule, name=spec.name)
            return np.asarray(p if spec.part == "packed" else s, np.uint8)[0]
        try:
            return nm.leaf_to_hf(a, spec)
        except ValueError as e:
            raise CheckpointError(f"cannot convert leaf {'/'.join(map(str, spec.path))}: {e}",
                                  tensor=spec.name) from None


def needs_distributed(params) -> bool:
    """True in a multi-process run, or when some leaf is not fully addressable here."""
    if jax.process_count() > 1:
        return True
    return any(hasattr(x, "is_fully_addressable") and not x.is_fully_addressable for x in jax.tree.leaves(params))


def write_shards(params, cfg, tmp: str, shards: list, rule: str = "even") -> tuple[dict[str, str], int, list[str]]:
    """Every process: write this process's tensors of ``shards`` ([(file name, specs)]) into ``tmp`` (created, and
    the files preallocated with their headers, by process 0), float expert stacks packed with the scale rule ``rule``
    (``save``'s ``scale_rule``). Returns (weight map, payload bytes, file names)."""
    me = jax.process_index()
    layouts = {f: shard_layout((s.name, s.dtype, s.shape) for s in specs) for f, specs in shards}
    if me == 0:
        os.makedirs(tmp)
        for f, _ in shards:
            lay = layouts[f]
            with open(os.path.join(tmp, f), "wb") as fh:
                fh.write(lay.prefix())
                fh.truncate(lay.file_bytes)
    barrier(f"k3jax save: files created in {tmp}")
    pieces = _Pieces(params, cfg, rule)
    failure = None
    try:
        pieces.gather_unheld(shards)
        for f, specs in shards:
            lay = layouts[f]
            mine = [s for s in specs if pieces.owner(s) == me]
            if not mine:
                continue
            base = len(lay.prefix())
            where = dict(zip(lay.names, lay.offsets))
            fd = os.open(os.path.join(tmp, f), os.O_WRONLY)
            try:
                for s in mine:
                    a = np.ascontiguousarray(pieces.get(s))
                    if a.dtype != nm.np_dtype(s.dtype) or tuple(a.shape) != tuple(s.shape):
                        raise CheckpointError(f"value {a.dtype}{list(a.shape)} does not match "
                                              f"{s.dtype}{list(s.shape)}", tensor=s.name)
                    start, end = where[s.name]
                    buf = a.view(np.uint8).reshape(-1)
                    if buf.size != end - start:
                        raise CheckpointError(f"{buf.size} bytes for a {end - start}-byte slot", tensor=s.name)
                    os.pwrite(fd, buf.data, base + start)
            finally:
                os.close(fd)
        for f, _ in shards:  # the sizes were fixed at creation; writes inside the slots cannot change them
            if me == 0 and os.path.getsize(os.path.join(tmp, f)) != layouts[f].file_bytes:
                raise CheckpointError(f"size {os.path.getsize(os.path.join(tmp, f))} != {layouts[f].file_bytes}",
                                      file=os.path.join(tmp, f))
    except BaseException as e:  # still reach the barrier, so the other processes are not left waiting
        failure = e
    failed = any_process(failure is not None)  # a collective: also the barrier after the writes
    if failed:
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure
        raise CheckpointError(f"another process failed while writing the checkpoint; {tmp} removed")
    weight_map = {s.name: f for f, specs in shards for s in specs}
    return weight_map, sum(layouts[f].payload_bytes for f, _ in shards), [f for f, _ in shards]


__all__ = ["needs_distributed", "write_shards"]
