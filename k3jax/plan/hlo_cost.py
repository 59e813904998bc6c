"""What a compiled program costs per device per step, from its HLO text (``k3jax.plan.hlo`` gives the computations
and how often each runs; every cost here is scaled by that multiplicity).

    stats = program_stats(compiled.as_text())
    stats.flops               # dot / convolution FLOPs, plus each custom call's own cost estimate
    stats.bytes_accessed      # HBM traffic; stats.hbm_split: weights / activations / kernels / collectives
    stats.collectives         # {"all-gather": {"count": n, "bytes": b}, ...}
    stats.custom_calls        # {custom-call target: count}; stats.kernels: per kernel (Mosaic / Triton) name,
                              # its count, FLOPs and bytes

FLOPs are those of ``dot`` (2 · output elements · contracted elements), ``ragged-dot`` (the same formula: rows ·
contraction · output columns, not per group) and ``convolution`` (2 · output batch × features · the (output, tap)
pairs that read a real input, not padding · input features per group); elementwise work is left out
(``cost_analysis`` includes it, counted once per body). A custom call (a Mosaic or Triton kernel) is opaque to XLA:
its FLOPs and HBM bytes are the ``cost_estimate`` its ``pallas_call`` declared (``pallas_kernels/mxfp4_matmul/
cost.py``: computed from the grid's block traffic), read from the call's backend config; a call without one is
charged its operands and result. Collective bytes are the bytes of each collective's result buffer per device (for
an async ``*-start``, its largest array), not link traffic: ring factors depend on the group and the topology and
are not modelled. ``bytes_accessed`` approximates HBM traffic the way XLA's cost model does for fused code — each
top-level instruction (a fusion being one kernel) reads its operands and writes its result once (``instr_io``:
slices and in-place updates count only the bytes they touch, a fusion only the slices of operands its body only
slices) — skipping tuples, parameters, constants, bitcasts and control flow. The split: ``kernels`` (Mosaic /
Triton custom calls), ``collectives`` (their instructions' reads and writes), ``weights`` (reads of the program's
arguments — the weights; in a train step also the optimizer state — directly or through views: slices, bitcasts,
copies, converts, gathers over the mesh, loop carries that pass them unchanged; ``argument_views``) and
``activations`` (the rest, other custom calls included). The bytes of one instruction: ``k3jax.plan.hlo_bytes``.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from k3jax.plan.hlo import (
    Computation,
    Instr,
    arrays,
    call_graph,
    callees,
    callers_first,
    multiplicities,
    parse,
    shape_bytes,
)
from k3jax.plan.hlo_bytes import argument_views, instr_io, is_argument

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "call", "conditional",
               "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency"}
_NO_TRAFFIC_TARGETS = {"AllocateBuffer"}  # XLA:TPU's buffer allocation custom call: no data moved
# custom calls that are kernels (Mosaic TPU, Triton, Mosaic GPU); other custom calls (host callbacks, XLA:CPU's
# library calls) are listed under custom_calls and their operands and results count as activations
KERNEL_TARGETS = {"tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2"}


def _dims_attr(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs)
    return tuple(int(x) for x in m.group(1).split(",") if x) if m else ()


def instr_flops(ins: Instr, shapes: dict[str, str]) -> float:
    if ins.opcode in ("dot", "ragged-dot"):
        out = arrays(ins.shape)
        lhs = arrays(shapes.get(ins.operands[0], "")) if ins.operands else []
        if not out or not lhs:
            return 0.0
        contract = math.prod(lhs[0][1][d] for d in _dims_attr(ins.attrs, "lhs_contracting_dims"))
        return 2.0 * math.prod(out[0][1]) * contract
    if ins.opcode == "convolution":
        return _conv_flops(ins, shapes)
    return 0.0


def _window(attrs: str, key: str, n: int, default: int) -> list[int]:
    m = re.search(rf"\b{key}=([0-9x_\-]+)", attrs)
    return [int(v) for v in m.group(1).split("x")] if m else [default] * n


def _valid_taps(I: int, K: int, O: int, lo: int, stride: int, lhs_dil: int, rhs_dil: int) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that read a real input element, not padding
    or a hole of the input dilation."""
    o = np.arange(O)[:, None]
    k = np.arange(K)[None, :]
    p = o * stride + k * rhs_dil - lo
    ok = (p >= 0) & (p <= (I - 1) * lhs_dil) & (p % lhs_dil == 0)
    return int(ok.sum())


def _conv_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """2 · (output batch × features) · Π_d (valid (output, tap) pairs of spatial dim d) · input features per group.
    Padding taps are not work: XLA:TPU writes some contractions as a convolution whose window covers one real
    input element and padding elsewhere (``window={size=96 pad=95_95}``), where kernel size × outputs would
    count 96x too much."""
    out = arrays(ins.shape)
    lhs = arrays(shapes.get(ins.operands[0], "")) if ins.operands else []
    rhs = arrays(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
    m = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", ins.attrs)
    if not out or not lhs or not rhs or not m:
        return 0.0
    ll, rl, ol = m.groups()
    out_d, lhs_d, rhs_d = out[0][1], lhs[0][1], rhs[0][1]
    spatial = sorted(c for c in ol if c.isdigit())
    n = len(spatial)
    pads = re.search(r"\bpad=([0-9x_\-]+)", ins.attrs)
    lo = [int(v.split("_")[0]) for v in pads.group(1).split("x")] if pads else [0] * n
    stride, ld, rd = (_window(ins.attrs, k, n, 1) for k in ("stride", "lhs_dilate", "rhs_dilate"))
    taps = 1
    for j, d in enumerate(spatial):
        taps *= _valid_taps(lhs_d[ll.index(d)], rhs_d[rl.index(d)], out_d[ol.index(d)], lo[j], stride[j], ld[j],
                            rd[j])
    rows = math.prod(out_d) / math.prod(out_d[ol.index(d)] for d in spatial)
    return 2.0 * rows * taps * rhs_d[rl.index("i")]


def _collective_kind(opcode: str) -> str | None:
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVES else None




# ---------------------------------------------------------------------------------------------------------------
# custom calls


def custom_call_target(ins: Instr) -> str | None:
    m = re.search(r'custom_call_target="([^"]+)"', ins.attrs) if ins.opcode == "custom-call" else None
    return m.group(1) if m else None


def kernel_name(ins: Instr) -> str:
    """A custom call's kernel: a pallas_call's ``name=`` as its op_name states it (``.../transpose(jvp(NAME))/
    pallas_call``, autodiff's wrappers removed), else the instruction name without XLA's ``.N`` suffix."""
    m = re.search(r'op_name="(?:[^"]*/)?([^/"]+)/pallas_call"', ins.attrs)
    if m is None:
        return re.sub(r"(\.\d+)+$", "", ins.name)
    name = m.group(1)
    while (w := re.fullmatch(r"[\w\-]+\((.*)\)", name)) is not None:
        name = w.group(1)
    return name


def custom_call_cost(ins: Instr) -> dict | None:
    """{"flops", "bytes"} a custom call declared (``"cost_estimate"`` in its backend config), else None."""
    m = re.search(r'"cost_estimate":(\{[^{}]*\})', ins.attrs)
    if not m:
        return None
    try:
        est = json.loads(m.group(1))
        return {"flops": float(est.get("flops", 0)), "bytes": float(est.get("bytes_accessed", 0))}
    except (json.JSONDecodeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------------------------
# the program


@dataclass
class ProgramStats:
    flops: float
    flops_once: float  # the same FLOPs with every computation counted once (what cost_analysis does for loops)
    bytes_accessed: float
    bytes_accessed_once: float
    collectives: dict
    collectives_once: dict
    trip_counts: list[int]
    unknown_trip_counts: int
    computations: int
    hbm_split: dict  # bytes_accessed by kind: weights, activations, kernels, collectives
    custom_calls: dict  # {custom-call target: count}
    kernels: dict  # {kernel name: {"count", "flops", "bytes", "estimated"}}
    scoped: dict  # {named scope: {"flops", "collectives": {kind: {"count", "bytes"}}}} for the scopes asked for

    def as_dict(self) -> dict:
        return {"flops": self.flops, "flops_counted_once": self.flops_once,
                "bytes_accessed": self.bytes_accessed, "bytes_accessed_counted_once": self.bytes_accessed_once,
                "hbm_bytes_split": self.hbm_split, "collectives": self.collectives,
                "collectives_counted_once": self.collectives_once, "custom_calls": self.custom_calls,
                "kernels": self.kernels, "scoped": self.scoped, "while_trip_counts": self.trip_counts,
                "unknown_trip_counts": self.unknown_trip_counts}


def largest_values(text: str, n: int = 10) -> list[dict]:
    """The ``n`` largest instruction results of the program outside fusion bodies (bytes per device, opcode, the
    JAX op that made it): where a memory plan's temporaries go."""
    comps, entry = parse(text)
    mult, fused, _, _ = multiplicities(comps, entry)
    rows = []
    for c in comps.values():
        if c.name in fused or not mult.get(c.name):
            continue
        for ins in c.instrs:
            if ins.opcode in ("parameter", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional"):
                continue
            m = re.search(r'op_name="([^"]*)"', ins.attrs)
            rows.append({"bytes": shape_bytes(ins.shape), "opcode": ins.opcode, "shape": ins.shape.split("{")[0],
                         "op_name": m.group(1)[-160:] if m else ""})
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:n]


def scope_members(comps: dict[str, Computation], entry: str, scope: str) -> set[tuple[str, str]]:
    """(computation, instruction) names inside named scope ``scope``: an instruction whose ``op_name`` metadata
    passes through it; one without metadata (XLA:CPU's library fusions drop it) takes its fusion's membership inside
    a fusion body, elsewhere its operands' (any operand in the scope) — so a dot that lost its metadata still
    counts where its inputs came from."""
    edges, fused, _, _ = call_graph(comps)
    body_of: dict[str, bool] = {}  # fusion body -> its fusion instruction is in the scope
    out: set[tuple[str, str]] = set()
    for cname in callers_first(edges, entry):
        c = comps.get(cname)
        if c is None:
            continue
        inside: set[str] = set()
        for ins in c.instrs:
            m = re.search(r'op_name="([^"]*)"', ins.attrs)
            if m:
                yes = scope in m.group(1).split("/")
            elif cname in fused:
                yes = body_of.get(cname, False)
            else:
                yes = any(o in inside for o in ins.operands)
            if yes:
                inside.add(ins.name)
                out.add((cname, ins.name))
            if ins.opcode == "fusion":
                for callee, _, _ in callees(ins):
                    body_of[callee] = body_of.get(callee, False) or yes
    return out


def instr_traffic(ins: Instr, c: Computation, comps: dict[str, Computation], est: dict | None = None
                  ) -> tuple[float, list[tuple[str, float]]] | None:
    """HBM bytes of one top-level instruction and its [(operand, bytes read)] (``hlo_bytes.instr_io``), or None for
    one that moves no data; a kernel with a cost estimate (``est``, ``custom_call_cost``) is charged the estimate."""
    target = custom_call_target(ins)
    if ins.opcode in _NO_TRAFFIC or ins.opcode.endswith("-done") or target in _NO_TRAFFIC_TARGETS:
        return None
    written, reads = instr_io(ins, c, comps)
    return (est["bytes"] if est else written + sum(r for _, r in reads)), reads


def program_stats(text: str, hints: dict[str, int] | None = None, scopes: tuple[str, ...] = ()) -> ProgramStats:
    """The costs of a compiled program's HLO text; ``hints``: trip counts of data-dependent loops by named scope
    (``hlo.hinted_trip_count``); ``scopes``: named scopes (``jax.named_scope``) whose FLOPs and collectives are
    also totalled on their own (``scoped``) — an instruction belongs to a scope when its ``op_name`` metadata
    passes through it (XLA keeps the metadata of the op an instruction came from, fused or not)."""
    comps, entry = parse(text)
    mult, fused, trips, unknown = multiplicities(comps, entry, hints)
    views = argument_views(comps, entry)
    flops = flops1 = traffic1 = 0.0
    split = dict.fromkeys(("weights", "activations", "kernels", "collectives"), 0.0)
    coll: dict = defaultdict(lambda: {"count": 0, "bytes": 0.0})
    coll1: dict = defaultdict(lambda: {"count": 0, "bytes": 0.0})
    calls: dict = defaultdict(int)
    kernels: dict = defaultdict(lambda: {"count": 0, "flops": 0.0, "bytes": 0.0, "estimated": True})
    scoped = {s: {"flops": 0.0, "collectives": defaultdict(lambda: {"count": 0, "bytes": 0.0})} for s in scopes}
    members = {s: scope_members(comps, entry, s) for s in scopes}
    for c in comps.values():
        m = mult.get(c.name, 0)
        if m == 0:
            continue
        info = views.get(c.name, {})
        for ins in c.instrs:
            target = custom_call_target(ins)
            est = custom_call_cost(ins) if target else None
            f = est["flops"] if est else instr_flops(ins, c.shapes)
            flops += m * f
            flops1 += f
            kind = _collective_kind(ins.opcode)
            inside = [s for s in scopes if (f or kind is not None) and (c.name, ins.name) in members[s]]
            for s in inside:
                scoped[s]["flops"] += m * f
            if kind is not None:
                b = shape_bytes(ins.shape, largest=ins.opcode.endswith("-start"))
                coll[kind]["count"] += m
                coll[kind]["bytes"] += m * b
                coll1[kind]["count"] += 1
                coll1[kind]["bytes"] += b
                for s in inside:
                    scoped[s]["collectives"][kind]["count"] += m
                    scoped[s]["collectives"][kind]["bytes"] += m * b
            if c.name in fused:
                continue
            if target:
                calls[target] += m
            traffic = instr_traffic(ins, c, comps, est)
            if traffic is None:
                continue
            t, reads = traffic
            if target in KERNEL_TARGETS or est is not None:
                k = kernels[kernel_name(ins)]
                k["count"] += m
                k["flops"] += m * f
                k["bytes"] += m * t
                k["estimated"] = k["estimated"] and est is not None
                split["kernels"] += m * t
            elif kind is not None:
                split["collectives"] += m * t
            else:
                w = sum(r for o, r in reads if is_argument(info.get(o, False)))
                split["weights"] += m * w
                split["activations"] += m * (t - w)
            traffic1 += t
    return ProgramStats(flops, flops1, sum(split.values()), traffic1, {k: dict(v) for k, v in sorted(coll.items())},
                        {k: dict(v) for k, v in sorted(coll1.items())}, sorted(trips), unknown, len(comps), split,
                        dict(sorted(calls.items())), {k: dict(v) for k, v in sorted(kernels.items())},
                        {s: {"flops": v["flops"],
                             "collectives": {k: dict(c) for k, c in sorted(v["collectives"].items())}}
                         for s, v in scoped.items()})


__all__ = ["COLLECTIVES", "KERNEL_TARGETS", "ProgramStats", "custom_call_cost", "custom_call_target",
           "instr_flops", "instr_traffic", "kernel_name", "largest_values", "program_stats", "scope_members"]
