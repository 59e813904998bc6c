"""A compiled XLA program's HLO text as computations, and how often each runs per step.

    comps, entry = parse(compiled.as_text())
    mult, fused, trips, unknown = multiplicities(comps, entry)   # {computation: runs per call of ENTRY}, ...

Why a parser: ``compiled.cost_analysis()`` counts a while body once (a 22-group scanned stack's flops come out
about 22x low) and reports no collectives; XLA exposes no per-computation costs to JAX. So the HLO text is read:
every computation gets a multiplicity — ENTRY 1; a while body its trip count times its caller's; a fusion,
call, async wrapper or conditional branch its caller's (every branch is counted, an upper bound). Reducer
computations (``to_apply``) are scalar and not followed. Trip counts come from XLA's ``known_trip_count`` or, where
the backend does not print it (XLA:TPU), from the loop's condition and initial value (``infer_trip_count``). A while
whose trip count is neither counts once and is listed as unknown, unless the caller gives its trip count by the
named scope that made it (``hints``: a data-dependent loop whose count the plan knows, such as the key blocks of a
cache filled to the planned context). What each instruction costs (FLOPs, HBM bytes,
collectives, custom calls) is ``k3jax.plan.hlo_cost``'s.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "tf32": 4,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "f6e2m3fn": 0.75, "f6e3m2fn": 0.75, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\((\d+)\)")  # a layout's memory space: S(0) / none = HBM; XLA:TPU's VMEM, SMEM, ... others
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_CALL_ATTRS = ("calls", "body", "branch_computations", "true_computation", "false_computation")


def arrays(shape: str, hbm: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in an HLO shape string (a tuple shape gives several); ``hbm``: only those in
    device memory (a layout naming another memory space, ``S(1)`` on TPU, is on-chip)."""
    out = []
    for dt, dims, layout in _ARRAY.findall(shape):
        if dt not in _DTYPE_BYTES:
            continue
        space = _ON_CHIP.search(layout) if hbm and layout else None
        if space is None or space.group(1) == "0":
            out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def shape_bytes(shape: str, largest: bool = False, hbm: bool = False) -> float:
    sizes = [math.prod(d) * _DTYPE_BYTES[dt] for dt, d in arrays(shape, hbm)]
    if not sizes:
        return 0.0
    return max(sizes) if largest else sum(sizes)


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape ``(a, (b, c), d)`` (a non-tuple shape: itself)."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                out.append(shape[start:i])
        elif ch == "," and depth == 1:
            out.append(shape[start:i])
            start = i + 1
    return [e.strip() for e in out if e.strip()]


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


def callees(ins: Instr, trip: int | None = None) -> list[tuple[str, int, bool]]:
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


def _op_name(ins: Instr) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def hinted_trip_count(ins: Instr, hints: dict[str, int] | None) -> int | None:
    """The trip count ``hints`` give a while loop the program cannot state: {named scope: trip count}, matched
    against the scopes of the loop's ``op_name`` (the scope that makes the loop, e.g.
    ``ops.latent_attention.LOOP_SCOPES``: how many key blocks a cache of the planned length holds)."""
    if not hints:
        return None
    scopes = _op_name(ins).split("/")
    found = [n for scope, n in hints.items() if scope in scopes]
    return found[-1] if found else None


def call_graph(comps: dict[str, Computation], hints: dict[str, int] | None = None
               ) -> tuple[dict[str, list[tuple[str, int]]], set[str], list, int]:
    """({caller: [(callee, repeat factor)]}, fusion-body computations, trip counts, loops of unknown count). A loop
    whose count the program does not state takes its ``hints`` entry (``hinted_trip_count``) when it has one."""
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    fused: set[str] = set()
    trips, unknown = [], 0
    for c in comps.values():
        for ins in c.instrs:
            t = None
            if ins.opcode == "while":
                t = infer_trip_count(comps, c, ins)
                t = hinted_trip_count(ins, hints) if t is None else t
            for callee, n, is_fusion in callees(ins, t):
                if callee in comps:
                    edges[c.name].append((callee, n))
                    if is_fusion:
                        fused.add(callee)
            if ins.opcode == "while":
                if t is None:
                    unknown += 1
                else:
                    trips.append(t)
    return edges, fused, trips, unknown


def callers_first(edges: dict[str, list[tuple[str, int]]], entry: str) -> list[str]:
    """The computations reachable from ``entry``, every caller before its callees (reverse post-order)."""
    order, seen = [], {entry}
    stack = [(entry, iter(edges.get(entry, ())))]
    while stack:  # post-order DFS (iterative: deep nests of calls)
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            order.append(node)
            stack.pop()
        elif nxt[0] not in seen:
            seen.add(nxt[0])
            stack.append((nxt[0], iter(edges.get(nxt[0], ()))))
    return order[::-1]


def multiplicities(comps: dict[str, Computation], entry: str, hints: dict[str, int] | None = None
                   ) -> tuple[dict[str, int], set[str], list, int]:
    """({computation: times it runs per call of ENTRY}, fusion-body computations, trip counts, unknown loops);
    ``hints``: trip counts of data-dependent loops by named scope (``call_graph``)."""
    edges, fused, trips, unknown = call_graph(comps, hints)
    mult: dict[str, int] = defaultdict(int)
    mult[entry] = 1
    for name in callers_first(edges, entry):
        for callee, n in edges[name]:
            mult[callee] += mult[name] * n
    return dict(mult), fused, trips, unknown

__all__ = ["Computation", "Instr", "arrays", "call_graph", "callees", "callers_first", "infer_trip_count",
           "multiplicities", "hinted_trip_count", "parse", "shape_bytes", "trip_count", "tuple_elements"]
