"""Costs of a compiled XLA program read from its HLO text, with loop bodies counted as often as they run.

    stats = program_stats(compiled.as_text())
    stats.flops               # dot / convolution FLOPs per device, each scaled by its computation's multiplicity
    stats.collectives         # {"all-gather": {"count": n, "bytes": b}, ...} per device per step, likewise scaled
    stats.trip_counts         # the known trip count of every while loop

Why a parser: ``compiled.cost_analysis()`` counts a while body once (a 22-group scanned stack's flops come out
about 22x low) and reports no collectives; XLA exposes no per-computation costs to JAX. So the HLO text is read:
every computation gets a multiplicity — ENTRY 1; a while body its trip count times its caller's; a fusion,
call, async wrapper or conditional branch its caller's (every branch is counted, an upper bound) — and each
instruction's cost is multiplied by the multiplicity of the computation it sits in. Reducer computations
(``to_apply``) are scalar and not followed. Trip counts come from XLA's ``known_trip_count`` or, where the backend
does not print it (XLA:TPU), from the loop's condition and initial value (``infer_trip_count``). A while whose
trip count is neither counts once and is listed in ``unknown_trip_counts``.

FLOPs are those of ``dot`` (2 · output elements · contracted elements), ``ragged-dot`` (the same formula: rows ·
contraction · output columns, not per group) and ``convolution`` (2 · output batch × features · the (output, tap)
pairs that read a real input, not padding · input features per group); elementwise work is left out
(``cost_analysis`` includes it, counted once per body). Collective bytes are the bytes of each collective's
result buffer per device (for an async ``*-start``, its largest array), not link traffic: ring factors depend on
the group and the topology and are not modelled. ``bytes_accessed`` approximates HBM traffic the way XLA's cost
model does for fused code — each top-level instruction (a fusion being one kernel) reads its operands and writes
its result once (``instr_traffic``: slices and in-place updates count only the bytes they touch) — skipping
tuples, parameters, constants, bitcasts and control flow.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "tf32": 4,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "f6e2m3fn": 0.75, "f6e3m2fn": 0.75, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_CALL_ATTRS = ("calls", "body", "branch_computations", "true_computation", "false_computation")

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "call", "conditional",
               "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency"}


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in an HLO shape string (a tuple shape gives several)."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)
            if dt in _DTYPE_BYTES]


def shape_bytes(shape: str, largest: bool = False) -> float:
    sizes = [math.prod(d) * _DTYPE_BYTES[dt] for dt, d in arrays(shape)]
    if not sizes:
        return 0.0
    return max(sizes) if largest else sum(sizes)


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text inside the opcode's parentheses (a constant's value)


@dataclass
class Computation:
    name: str
    instrs: list[Instr] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for j in range(i, len(s)):
        c = s[j]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    return len(s)


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(2), m.group(3)
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
    shape, tail = rest[:end], rest[end:]
    om = _OPCODE.match(tail)
    if not om:
        return None
    opcode = om.group(1)
    start = om.end() - 1
    close = _balanced(tail, start)
    operands = re.findall(r"%([\w.\-]+)", tail[start:close])
    return Instr(name, shape, opcode, operands, tail[close:], tail[start + 1:close - 1])


def parse(text: str) -> tuple[dict[str, Computation], str]:
    """({name: Computation}, entry name) of an HLO module's text."""
    comps: dict[str, Computation] = {}
    entry = None
    cur = None
    for line in text.splitlines():
        if cur is None:
            h = _HEADER.match(line)
            if h:
                cur = Computation(h.group(2))
                comps[cur.name] = cur
                if h.group(1):
                    entry = cur.name
                for pname, pshape in re.findall(r"([\w.\-]+):\s*((?:\([^)]*\))|[^,()]+(?:\{[^}]*\})?)", h.group(3)):
                    cur.shapes[pname] = pshape
            continue
        if line.startswith("}"):
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            cur.instrs.append(ins)
            cur.shapes[ins.name] = ins.shape
    if entry is None:
        raise ValueError("HLO text has no ENTRY computation")
    return comps, entry


def _callees(ins: Instr, trip: int | None = None) -> list[tuple[str, int, bool]]:
    """(computation, repeat factor, is a fusion body) called by one instruction; reducers are not followed.
    ``trip``: a while loop's trip count (None: unknown, counted once)."""
    out = []
    for attr in _CALL_ATTRS:
        m = re.search(rf"\b{attr}=(\{{[^}}]*\}}|%?[\w.\-]+)", ins.attrs)
        if not m:
            continue
        names = re.findall(r"%?([\w.\-]+)", m.group(1).strip("{}"))
        n = 1
        if attr == "body":
            n = trip if trip is not None else 1
        out.extend((c, n, ins.opcode == "fusion") for c in names)
    return out


def trip_count(ins: Instr) -> int | None:
    m = re.search(r"backend_config=(\{.*\})", ins.attrs)
    if not m:
        return None
    cfg = m.group(1)
    try:
        n = json.loads(cfg[:_balanced(cfg, 0)]).get("known_trip_count", {}).get("n")
    except (json.JSONDecodeError, AttributeError):
        t = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', cfg)
        n = t.group(1) if t else None
    return None if n is None else int(n)


def _constant(c: Computation, name: str) -> int | None:
    for ins in c.instrs:
        if ins.name == name:
            if ins.opcode == "constant":
                return int(ins.args) if re.fullmatch(r"\s*-?\d+\s*", ins.args) else None
            if ins.opcode == "copy" and ins.operands:
                return _constant(c, ins.operands[0])
            return None
    return None


def _cond_bound(comps: dict, cond: Computation) -> tuple[int, int] | None:
    """(tuple index of the induction variable, bound N) of a loop condition ``ROOT compare(gte(p, k), N), LT``
    (directly, or as a fusion of exactly that), else None."""
    root = cond.instrs[-1] if cond.instrs else None
    if root is None:
        return None
    if root.opcode == "fusion":
        m = re.search(r"calls=%?([\w.\-]+)", root.attrs)
        body = comps.get(m.group(1)) if m else None
        inner = body.instrs[-1] if body and body.instrs else None
        if inner is None or inner.opcode != "compare" or "direction=LT" not in inner.attrs:
            return None
        params = {i.name: int(i.args) for i in body.instrs if i.opcode == "parameter" and i.args.isdigit()}
        try:
            lhs, rhs = (root.operands[params[o]] for o in inner.operands[:2])
        except (KeyError, IndexError):
            return None
    elif root.opcode == "compare" and "direction=LT" in root.attrs and len(root.operands) >= 2:
        lhs, rhs = root.operands[:2]
    else:
        return None
    gte = next((i for i in cond.instrs if i.name == lhs and i.opcode == "get-tuple-element"), None)
    bound = _constant(cond, rhs)
    k = re.search(r"index=(\d+)", gte.attrs) if gte else None
    return (int(k.group(1)), bound) if k and bound is not None else None


def infer_trip_count(comps: dict, caller: Computation, ins: Instr) -> int | None:
    """A while loop's trip count: XLA's ``known_trip_count`` when the backend prints it (XLA:CPU does), else read
    from the loop (XLA:TPU prints none): a condition ``induction < N`` on a tuple element the loop starts at a
    constant c gives N - c (step 1, as lax.scan and fori_loop emit). A bound that is not a constant (a loop
    over a data-dependent count) stays unknown."""
    t = trip_count(ins)
    if t is not None:
        return t
    m = re.search(r"condition=%?([\w.\-]+)", ins.attrs)
    cond = comps.get(m.group(1)) if m else None
    kb = _cond_bound(comps, cond) if cond else None
    if kb is None or not ins.operands:
        return None
    k, bound = kb
    tup = next((i for i in caller.instrs if i.name == ins.operands[0]), None)
    if tup is None or tup.opcode != "tuple" or k >= len(tup.operands):
        return None
    start = _constant(caller, tup.operands[k])
    return None if start is None else max(bound - start, 0)


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

    def as_dict(self) -> dict:
        return {"flops": self.flops, "flops_counted_once": self.flops_once,
                "bytes_accessed": self.bytes_accessed, "bytes_accessed_counted_once": self.bytes_accessed_once,
                "collectives": self.collectives, "collectives_counted_once": self.collectives_once,
                "while_trip_counts": self.trip_counts, "unknown_trip_counts": self.unknown_trip_counts}


def multiplicities(comps: dict[str, Computation], entry: str) -> tuple[dict[str, int], set[str], list, int]:
    """({computation: times it runs per call of ENTRY}, fusion-body computations, trip counts, unknown loops)."""
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    fused: set[str] = set()
    trips, unknown = [], 0
    for c in comps.values():
        for ins in c.instrs:
            t = infer_trip_count(comps, c, ins) if ins.opcode == "while" else None
            for callee, n, is_fusion in _callees(ins, t):
                if callee in comps:
                    edges[c.name].append((callee, n))
                    if is_fusion:
                        fused.add(callee)
            if ins.opcode == "while":
                if t is None:
                    unknown += 1
                else:
                    trips.append(t)
    order, seen = [], set()

    def visit(name):  # post-order DFS (iterative: deep nests of calls)
        stack = [(name, iter(edges[name]))]
        seen.add(name)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                order.append(node)
                stack.pop()
            elif nxt[0] not in seen:
                seen.add(nxt[0])
                stack.append((nxt[0], iter(edges[nxt[0]])))

    visit(entry)
    mult: dict[str, int] = defaultdict(int)
    mult[entry] = 1
    for name in reversed(order):  # callers before callees
        for callee, n in edges[name]:
            mult[callee] += mult[name] * n
    return dict(mult), fused, trips, unknown


_SLICING = ("dynamic-slice", "slice", "gather")


def _read_bytes(body: Computation, index: int, full: float) -> float:
    """Bytes a fusion reads of its parameter ``index``: only the slices when every use of it is a (dynamic) slice
    or gather of it (a loop body's view of one layer of a stacked weight), else all of it."""
    pname = next((i.name for i in body.instrs if i.opcode == "parameter" and i.args.strip() == str(index)), None)
    users = [i for i in body.instrs if pname in i.operands]
    if not users or any(u.opcode not in _SLICING or u.operands[0] != pname for u in users):
        return full
    return sum(shape_bytes(u.shape) for u in users)


def instr_traffic(ins: Instr, c: Computation, comps: dict) -> float:
    """HBM bytes of one top-level instruction: its result written and its operands read once, where a (dynamic)
    slice reads only its slice, a dynamic-update-slice writes (and reads) only its update in place, and a fusion
    reads only the slices of the operands its body only slices."""
    if ins.opcode in _SLICING:
        return 2 * shape_bytes(ins.shape)
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
        return 2 * shape_bytes(c.shapes.get(ins.operands[1], ""))
    reads = [shape_bytes(c.shapes.get(o, "")) for o in ins.operands]
    if ins.opcode == "fusion":
        m = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
        body = comps.get(m.group(1)) if m else None
        if body is not None:
            reads = [_read_bytes(body, i, r) for i, r in enumerate(reads)]
            root = body.instrs[-1] if body.instrs else None
            if root is not None and root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
                # an in-place update of a loop-carried buffer: the buffer operand is neither read nor rewritten
                upd = shape_bytes(body.shapes.get(root.operands[1], ""))
                buf = body.shapes.get(root.operands[0], "")
                return upd + sum(r for r, o in zip(reads, ins.operands, strict=True)
                                 if c.shapes.get(o, "") != buf) + upd
    return shape_bytes(ins.shape) + sum(reads)


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


def program_stats(text: str) -> ProgramStats:
    comps, entry = parse(text)
    mult, fused, trips, unknown = multiplicities(comps, entry)
    flops = flops1 = traffic = traffic1 = 0.0
    coll: dict = defaultdict(lambda: {"count": 0, "bytes": 0.0})
    coll1: dict = defaultdict(lambda: {"count": 0, "bytes": 0.0})
    for c in comps.values():
        m = mult.get(c.name, 0)
        if m == 0:
            continue
        for ins in c.instrs:
            f = instr_flops(ins, c.shapes)
            flops += m * f
            flops1 += f
            kind = _collective_kind(ins.opcode)
            if kind is not None:
                b = shape_bytes(ins.shape, largest=ins.opcode.endswith("-start"))
                coll[kind]["count"] += m
                coll[kind]["bytes"] += m * b
                coll1[kind]["count"] += 1
                coll1[kind]["bytes"] += b
            if c.name not in fused and ins.opcode not in _NO_TRAFFIC and not ins.opcode.endswith("-done"):
                t = instr_traffic(ins, c, comps)
                traffic += m * t
                traffic1 += t
    return ProgramStats(flops, flops1, traffic, traffic1, {k: dict(v) for k, v in sorted(coll.items())},
                        {k: dict(v) for k, v in sorted(coll1.items())}, sorted(trips), unknown, len(comps))


__all__ = ["COLLECTIVES", "ProgramStats", "arrays", "infer_trip_count", "largest_values", "multiplicities", "parse",
           "program_stats", "shape_bytes", "trip_count"]
