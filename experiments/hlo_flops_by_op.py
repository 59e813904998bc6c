"""Where a compiled program's FLOPs or HBM bytes go: the loop-corrected dot / convolution FLOPs (``--cost flops``)
or the per-instruction HBM bytes of ``k3jax.plan.hlo_cost.program_stats`` (``--cost bytes``: each top-level
instruction's reads and writes as ``hlo_bytes.instr_io`` counts them, kernels at their cost estimate) of an HLO text
(``k3 plan --compile --hlo-out PATH``), grouped by source op (jaxpr op_name, digits folded), by result and operand
shapes, by the Python source that made it (``--by source``: the innermost project frames of the op's recorded
stack; ops made by autodiff's transposition carry the stack of the transformation), or listed per instruction
(``--by instr``: its computation, opcode, and the bytes of each operand read), the largest groups first (loops with
unknown trip counts are counted once).

    python experiments/hlo_flops_by_op.py /tmp/v6e.hlo                  # FLOPs by source op
    python experiments/hlo_flops_by_op.py /tmp/v6e.hlo --by shape --grep "jit(step)/cond/"   # the optimizer update
    python experiments/hlo_flops_by_op.py /tmp/frozen.hlo --cost bytes --by instr     # the largest HBM consumers

Used for the v6e-256 frozen-experts plan in experiments/LOG.md (2026-12-03): the replicated Newton–Schulz A·A; and
for the v5p-512 frozen-experts byte split (2026-12-05, session 21).
"""

import argparse
import re
from collections import defaultdict

from k3jax.plan.hlo import multiplicities, parse
from k3jax.plan.hlo_cost import custom_call_cost, custom_call_target, instr_flops, instr_traffic


def _strip(shape: str) -> str:
    return re.sub(r"\{[^}]*\}", "", shape)


def _op(ins) -> str:
    op = re.search(r'op_name="([^"]*)"', ins.attrs)
    return re.sub(r"\d+", "#", op.group(1))[-140:] if op else "?"


def stack_frames(text: str) -> dict[int, list[str]]:
    """stack_frame_id → its frames, innermost first, as "file:function:line" (the HLO text's FileNames /
    FunctionNames / FileLocations / StackFrames tables; jax records the Python stack of each op there)."""
    tables: dict[str, dict[int, str]] = {}
    cur = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur = tables.setdefault(line, {})
        elif cur is not None and (m := re.match(r"(\d+) (.*)$", line)):
            cur[int(m.group(1))] = m.group(2)
        elif cur is not None and line.strip() and not line[0].isdigit():
            cur = None
    files = {k: v.strip('"').split("/work/main/")[-1] for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locs = {}
    for k, v in tables.get("FileLocations", {}).items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        locs[k] = f"{files.get(int(f['file_name_id']), '?')}:{funcs.get(int(f['function_name_id']), '?')}:{f['line']}"
    parent = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in tables.get("StackFrames", {}).items()}
    out: dict[int, list[str]] = {}
    for k in parent:
        chain, j = [], k
        while j in parent and len(chain) < 64:
            chain.append(locs.get(int(parent[j]["file_location_id"]), "?"))
            nxt = int(parent[j]["parent_frame_id"])
            if nxt == j or nxt == 0:
                break
            j = nxt
        out[k] = chain
    return out


def _source(ins, frames: dict[int, list[str]], depth: int) -> str:
    """The ``depth`` innermost project frames (k3jax/, pallas_kernels/) of an instruction's Python stack."""
    m = re.search(r"stack_frame_id=(\d+)", ins.attrs)
    own = [f for f in frames.get(int(m.group(1)), []) if f.startswith(("k3jax/", "pallas_kernels/"))] if m else []
    return " < ".join(own[:depth]) or "?"


def _bytes(ins, c, comps) -> tuple[float, list]:
    """(HBM bytes, [(operand, bytes read)]) of a top-level instruction, as program_stats counts them."""
    traffic = instr_traffic(ins, c, comps, custom_call_cost(ins) if custom_call_target(ins) else None)
    return traffic if traffic is not None else (0.0, [])


def groups(text: str, by: str = "op", grep: str | None = None, cost: str = "flops", depth: int = 2
           ) -> tuple[float, int, list]:
    """(total, loops with unknown trip counts, [(cost, instructions x multiplicity, key)] largest first)."""
    comps, entry = parse(text)
    frames = stack_frames(text) if by == "source" else {}
    mult, fused, _, unknown = multiplicities(comps, entry)
    acc: dict = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for c in comps.values():
        m = mult.get(c.name, 0)
        if not m or (cost == "bytes" and c.name in fused):
            continue
        for ins in c.instrs:
            if cost == "flops":
                f, reads = instr_flops(ins, c.shapes), []
            else:
                f, reads = _bytes(ins, c, comps)
            if not f or (grep and grep not in ins.attrs):
                continue
            if by == "op":
                key = _op(ins)
            elif by == "source":
                key = _source(ins, frames, depth)
            elif by == "shape":
                key = f"{_strip(ins.shape)} <- " + ", ".join(_strip(c.shapes.get(o, "?")) for o in ins.operands[:2])
            else:
                rd = ", ".join(f"{_strip(c.shapes.get(o, '?'))[:60]}:{r / 1e9:.2f}GB" for o, r in reads if r)
                key = f"{c.name}/{ins.name} {ins.opcode} {_strip(ins.shape)[:80]} <- [{rd}] {_op(ins)}"
            acc[key][0] += m * f
            acc[key][1] += m
            total += m * f
    return total, unknown, sorted(((f, n, k) for k, (f, n) in acc.items()), reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo")
    ap.add_argument("--by", choices=("op", "shape", "instr", "source"), default="op")
    ap.add_argument("--cost", choices=("flops", "bytes"), default="flops")
    ap.add_argument("--grep", default=None, help="only instructions whose attributes contain this")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--depth", type=int, default=2, help="--by source: project frames per key, innermost first")
    args = ap.parse_args()
    with open(args.hlo) as f:
        total, unknown, rows = groups(f.read(), args.by, args.grep, args.cost, args.depth)
    unit = "FLOPs" if args.cost == "flops" else "HBM bytes"
    print(f"total {total:.4g} {unit} per device; loops with unknown trip counts (counted once): {unknown}")
    for f, n, k in rows[:args.top]:
        print(f"{f:.3e} {100 * f / total:5.1f}%  x{n:<7} {k}")


if __name__ == "__main__":
    main()
