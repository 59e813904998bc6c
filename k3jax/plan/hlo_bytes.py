"""HBM bytes of a compiled program's instructions (``k3jax.plan.hlo_cost`` totals them per step): which values are
(views of) the program's arguments, and what one top-level instruction reads and writes.

    views = argument_views(comps, entry)          # {computation: {value: is (a view of) an argument}}
    written, reads = instr_io(ins, comp, comps)   # bytes written, [(operand, bytes read)]

XLA's cost model for fused code, approximated: each top-level instruction (a fusion being one kernel) reads its
operands and writes its result once; slices and in-place updates count only the bytes they touch, a fusion only the
slices of operands its body only slices (also through elementwise views and nested fusions), a fusion that updates a
buffer in place (also one output of a multi-output fusion) only the slot it writes. A read of an argument — directly
or through views: slices, bitcasts, copies, converts, gathers over the mesh, loop carries that pass them unchanged —
is a weight read (``argument_views``).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from k3jax.plan.hlo import (
    Computation,
    Instr,
    arrays,
    call_graph,
    callers_first,
    shape_bytes,
    tuple_elements,
)

# ---------------------------------------------------------------------------------------------------------------
# which values are (views of) the program's arguments

_VIEWS = {"bitcast", "copy", "reshape", "transpose", "slice", "dynamic-slice", "gather", "convert", "all-gather",
          "all-gather-start", "all-gather-done", "copy-start", "copy-done", "optimization-barrier"}


def is_argument(info) -> bool:
    """Whether a value's view info (``argument_views``; a tuple for a tuple value) marks any part an argument."""
    return any(is_argument(i) for i in info) if isinstance(info, tuple) else bool(info)


def _param_index(ins: Instr) -> int | None:
    return int(ins.args) if ins.opcode == "parameter" and ins.args.strip().isdigit() else None


def _invariant(body: Computation) -> set[int]:
    """Tuple elements a while body passes through unchanged: ROOT tuple element k is (a view chain of) gte(param, k)."""
    by_name = {i.name: i for i in body.instrs}
    root = body.instrs[-1] if body.instrs else None
    if root is None or root.opcode != "tuple":
        return set()
    out = set()
    for k, o in enumerate(root.operands):
        ins = by_name.get(o)
        while ins is not None and ins.opcode in ("bitcast", "copy") and ins.operands:
            ins = by_name.get(ins.operands[0])
        if ins is not None and ins.opcode == "get-tuple-element" and re.search(rf"\bindex={k}\b", ins.attrs) \
                and _param_index(by_name.get(ins.operands[0], ins)) == 0:
            out.add(k)
    return out


def _merge(a, b):
    """Both callers' views (a value is an argument view only if it is one from every call site)."""
    if a is None:
        return b
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_merge(x, y) for x, y in zip(a, b, strict=True))
    return is_argument(a) and is_argument(b) if isinstance(a, tuple) or isinstance(b, tuple) else a and b


def argument_views(comps: dict[str, Computation], entry: str) -> dict[str, dict[str, object]]:
    """{computation: {value: info}}: info True when the value is (a view of) a program argument, a tuple of infos
    for a tuple value, False otherwise (see the module docstring)."""
    edges, _, _, _ = call_graph(comps)
    params: dict[str, dict[int, object]] = defaultdict(dict)  # callee -> {parameter index: info}
    out: dict[str, dict[str, object]] = {}
    for cname in callers_first(edges, entry):
        c = comps[cname]
        info: dict[str, object] = {}
        get = info.get
        for ins in c.instrs:
            op = ins.opcode
            if op == "parameter":
                v = True if cname == entry else params[cname].get(_param_index(ins), False)
            elif op == "get-tuple-element":
                src = get(ins.operands[0], False) if ins.operands else False
                k = re.search(r"\bindex=(\d+)", ins.attrs)
                v = src[int(k.group(1))] if isinstance(src, tuple) and k and int(k.group(1)) < len(src) else src
            elif op == "tuple":
                v = tuple(get(o, False) for o in ins.operands)
            elif op in _VIEWS and ins.operands:
                v = get(ins.operands[0], False)
            elif op == "while" and ins.operands:
                body = re.search(r"\bbody=%?([\w.\-]+)", ins.attrs)
                src = get(ins.operands[0], False)
                keep = _invariant(comps[body.group(1)]) if body and body.group(1) in comps else set()
                v = tuple(x if k in keep else False for k, x in enumerate(src)) if isinstance(src, tuple) else False
                for attr in ("body", "condition"):
                    m = re.search(rf"\b{attr}=%?([\w.\-]+)", ins.attrs)
                    if m:
                        params[m.group(1)][0] = _merge(params[m.group(1)].get(0), v)
            elif op == "fusion":
                m = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
                v = _fusion_view(comps.get(m.group(1)) if m else None, [get(o, False) for o in ins.operands])
            else:
                v = False
            for callee, index, val in _calls(ins, [get(o, False) for o in ins.operands]):
                params[callee][index] = _merge(params[callee].get(index), val)
            info[ins.name] = v
        out[cname] = info
    return out


def _calls(ins: Instr, operand_infos: list) -> list[tuple[str, int, object]]:
    """(callee, parameter index, info) for each parameter of a computation ``ins`` calls: a call or async
    wrapper's parameters are its operands; a while's body and condition take its (invariant-masked) tuple; a
    conditional's branch i takes operand i + 1. Fusion bodies hold no top-level instruction: not followed."""
    if ins.opcode == "while":
        return []  # handled with the loop's invariant mask in argument_views
    if ins.opcode == "conditional":
        m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        names = re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []
        return [(b, 0, operand_infos[i + 1]) for i, b in enumerate(names) if i + 1 < len(operand_infos)]
    m = re.search(r"\b(?:calls|to_apply)=%?([\w.\-]+)", ins.attrs)
    if m is None or ins.opcode == "fusion" or ins.opcode in ("reduce", "reduce-window", "scatter", "sort", "map",
                                                             "select-and-scatter", "all-reduce", "reduce-scatter"):
        return []
    return [(m.group(1), i, v) for i, v in enumerate(operand_infos)]


def _fusion_view(body: Computation | None, operand_infos: list) -> bool:
    """A fusion's result is an argument view when its body's ROOT is a chain of view ops of one parameter whose
    operand is one (a slice of a stacked weight, converted to the compute dtype)."""
    if body is None or not body.instrs:
        return False
    by_name = {i.name: i for i in body.instrs}
    ins = body.instrs[-1]
    while ins is not None and ins.opcode in _VIEWS and ins.operands:
        ins = by_name.get(ins.operands[0])
    k = _param_index(ins) if ins is not None else None
    return k is not None and k < len(operand_infos) and is_argument(operand_infos[k])


# ---------------------------------------------------------------------------------------------------------------
# HBM traffic

_SLICING = ("dynamic-slice", "slice", "gather")


# Elementwise ops of one operand inside a fusion body: the body computes each output element from the same element of
# the operand, on demand, so a slice of their result reads only that slice of the operand.
_ELEMENTWISE_VIEWS = ("bitcast", "copy", "convert", "reshape", "transpose")


def _demanded(body: Computation, name: str, per_elem: float, comps: dict | None) -> float | None:
    """Bytes of value ``name`` that a fusion body reads when every use of it is a (dynamic) slice or gather, also
    through elementwise views of it and through fusions nested in the body (a nested fusion that only views its
    operand is such a view; XLA:TPU nests a layout copy of a stacked weight before the slice of one layer); None
    when some use reads it all. ``per_elem``: HBM bytes per element of the original operand."""
    users = [i for i in body.instrs if name in i.operands]
    if not users:
        return None
    total = 0.0
    for u in users:
        if u.operands.count(name) != 1:
            return None
        if u.opcode in _SLICING and u.operands[0] == name:
            total += per_elem * sum(math.prod(d) for _, d in arrays(u.shape))
            continue
        if u.opcode in _ELEMENTWISE_VIEWS and len(u.operands) == 1:
            got = _demanded(body, u.name, per_elem, comps)
        elif u.opcode == "fusion" and comps:
            m = re.search(r"calls=%?([\w.\-]+)", u.attrs)
            nested = comps.get(m.group(1)) if m else None
            if nested is None:
                return None
            k = u.operands.index(name)
            if _views_param(nested, k):                       # the nested fusion is a view: follow its users here
                got = _demanded(body, u.name, per_elem, comps)
            else:
                pname = _param_name(nested, k)
                got = _demanded(nested, pname, per_elem, comps) if pname else None
        else:
            return None
        if got is None:
            return None
        total += got
    return total


def _param_name(body: Computation, index: int) -> str | None:
    return next((i.name for i in body.instrs if i.opcode == "parameter" and i.args.strip() == str(index)), None)


def _views_param(body: Computation, index: int) -> bool:
    """Whether a fusion body's ROOT is a chain of elementwise views of its parameter ``index`` alone."""
    by_name = {i.name: i for i in body.instrs}
    ins = body.instrs[-1] if body.instrs else None
    while ins is not None and ins.opcode in _ELEMENTWISE_VIEWS and len(ins.operands) == 1:
        ins = by_name.get(ins.operands[0])
    return ins is not None and ins.opcode == "parameter" and ins.args.strip() == str(index)


def _read_bytes(body: Computation, index: int, full: float, comps: dict | None = None) -> float:
    """Bytes a fusion reads of its parameter ``index``: only the slices when every use of it is a (dynamic) slice
    or gather of it (a loop body's view of one layer of a stacked weight, a key block of a stacked cache), also
    through elementwise views and nested fusions (``_demanded``), else all of it."""
    pname = _param_name(body, index)
    elems = sum(math.prod(d) for _, d in arrays(body.shapes.get(pname, ""))) if pname else 0
    got = _demanded(body, pname, full / elems, comps) if pname and elems else None
    return full if got is None else min(got, full)


def _in_place(root: Instr | None, shapes: dict) -> tuple[str, str] | None:
    """(buffer operand, update operand) of an instruction that updates its operand 0 in place: a
    dynamic-update-slice, or a scatter whose result has its operand's shape (XLA aliases them: the TPU compiler
    states it as the fusion's ``aliasing_operands``), else None."""
    if root is None or len(root.operands) < 2:
        return None
    if root.opcode == "dynamic-update-slice":
        return root.operands[0], root.operands[1]
    if root.opcode == "scatter" and len(root.operands) == 3 and \
            arrays(shapes.get(root.operands[0], "")) == arrays(root.shape):
        return root.operands[0], root.operands[2]
    return None


def instr_io(ins: Instr, c: Computation, comps: dict) -> tuple[float, list[tuple[str, float]]]:
    """(HBM bytes written, [(operand, HBM bytes read)]) of one top-level instruction: its result written and its
    operands read once, where a (dynamic) slice reads only its slice, a dynamic-update-slice or a scatter into an
    operand of its result's shape writes (and reads) only its update in place (the scatter's indices are read), a
    fusion reads only the slices of the operands its body only slices (nested fusions included), an async ``*-start``
    / ``*-update`` (shape ``((operands), result, context)``) writes only its result (an update's operand 0 is its
    start's context) — but a ``copy-start``, shaped ``(destination, source, context)`` (its ``copy-done`` is element
    0), writes its destination: a prefetch into VMEM reads HBM once, an eviction from VMEM writes it once —, and
    arrays in an on-chip memory space (``S(1)``: VMEM) cost nothing."""
    ops = ins.operands

    def hbm(shape: str) -> float:
        return shape_bytes(shape, hbm=True)

    if ins.opcode.endswith(("-start", "-update")):
        parts = tuple_elements(ins.shape)
        ins_ops = ops[1:] if ins.opcode.endswith("-update") else ops
        out = 0 if ins.opcode == "copy-start" else 1
        return (hbm(parts[out]) if len(parts) > out else 0.0), [(o, hbm(c.shapes.get(o, ""))) for o in ins_ops]
    if ins.opcode in _SLICING:
        return hbm(ins.shape), [(ops[0], hbm(ins.shape))] if ops else []
    place = _in_place(ins, c.shapes)
    if place is not None:
        upd = hbm(c.shapes.get(place[1], ""))
        return upd, [(o, hbm(c.shapes.get(o, ""))) for o in ops if o != place[0]]
    reads = [hbm(c.shapes.get(o, "")) for o in ops]
    if ins.opcode == "fusion":
        m = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
        body = comps.get(m.group(1)) if m else None
        if body is not None:
            reads = [min(_read_bytes(body, i, r, comps), r) for i, r in enumerate(reads)]
            updated = _fusion_updates(body)
            if updated:
                # in-place updates of loop-carried buffers (the ROOT, or elements of a multi-output ROOT tuple): a
                # buffer parameter is not rewritten, its update is written; the update is computed from the other
                # operands (read as they are read), and the buffer's slot is read only where the body reads the
                # buffer otherwise than as the update's target (read-modify-write); the other outputs are written
                # whole
                written = sum(updated.values()) + sum(hbm(e) for i, e in enumerate(tuple_elements(ins.shape))
                                                      if i not in _updated_outputs(body))
                slots = sum(u for k, u in updated.items() if _reads_buffer(body, k))
                return written, [(o, r) for k, (o, r) in enumerate(zip(ops, reads, strict=True)) if k not in updated] \
                    + ([("", slots)] if slots else [])
    return hbm(ins.shape), list(zip(ops, reads, strict=True))


def _root_outputs(body: Computation) -> list[Instr]:
    """A fusion body's outputs: its ROOT, or the elements of a ROOT tuple."""
    by_name = {i.name: i for i in body.instrs}
    root = body.instrs[-1] if body.instrs else None
    if root is None:
        return []
    return [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]


def _updated_outputs(body: Computation) -> set[int]:
    """Positions of a fusion's outputs that update one of its parameters in place (``_in_place``)."""
    return {i for i, o in enumerate(_root_outputs(body)) if o is not None and _in_place_param(o, body) is not None}


def _in_place_param(o: Instr, body: Computation) -> tuple[int, float] | None:
    place = _in_place(o, body.shapes)
    if place is None:
        return None
    p = next((i for i in body.instrs if i.name == place[0] and i.opcode == "parameter"), None)
    return None if p is None or not p.args.strip().isdigit() else (int(p.args), shape_bytes(body.shapes.get(place[1],
                                                                                                          "")))


def _reads_buffer(body: Computation, index: int) -> bool:
    """Whether a fusion body uses its parameter ``index`` other than as the buffer a dynamic-update-slice targets:
    a read-modify-write of the slot reads it (a scatter's combiner does)."""
    name = _param_name(body, index)
    root = body.instrs[-1] if body.instrs else None
    for i in body.instrs:
        if i is root and i.opcode == "tuple":
            continue
        ops = i.operands[1:] if i.opcode == "dynamic-update-slice" and i.operands[0] == name else i.operands
        if name in ops:
            return True
    return False


def _fusion_updates(body: Computation) -> dict[int, float]:
    """{parameter index: update bytes} of the parameters a fusion updates in place."""
    out = {}
    for o in _root_outputs(body):
        got = _in_place_param(o, body) if o is not None else None
        if got is not None:
            out[got[0]] = out.get(got[0], 0.0) + got[1]
    return out


__all__ = ["argument_views", "instr_io", "is_argument"]
