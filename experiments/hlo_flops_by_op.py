"""Where a compiled program's FLOPs go: the loop-corrected dot / convolution FLOPs of an HLO text (``k3 plan
--compile --hlo-out PATH``) grouped by source op (jaxpr op_name, digits folded) or by result and operand shapes,
the largest groups first (``k3jax.plan.hlo``'s counts; loops with unknown trip counts are counted once).

    python experiments/hlo_flops_by_op.py /tmp/v6e.hlo                  # by source op
    python experiments/hlo_flops_by_op.py /tmp/v6e.hlo --by shape --grep "jit(step)/cond/"   # the optimizer update (inside the finite check)

Used for the v6e-256 frozen-experts plan in experiments/LOG.md (2026-12-03): the replicated Newton–Schulz A·A.
"""

import argparse
import re
from collections import defaultdict

from k3jax.plan.hlo import multiplicities, parse
from k3jax.plan.hlo_cost import instr_flops


def _strip(shape: str) -> str:
    return re.sub(r"\{[^}]*\}", "", shape)


def groups(text: str, by: str = "op", grep: str | None = None) -> tuple[float, int, list]:
    """(total FLOPs, loops with unknown trip counts, [(flops, instructions x multiplicity, key)] largest first)."""
    comps, entry = parse(text)
    mult, _, _, unknown = multiplicities(comps, entry)
    acc: dict = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for c in comps.values():
        m = mult.get(c.name, 0)
        if not m:
            continue
        for ins in c.instrs:
            f = instr_flops(ins, c.shapes)
            if not f or (grep and grep not in ins.attrs):
                continue
            if by == "op":
                op = re.search(r'op_name="([^"]*)"', ins.attrs)
                key = re.sub(r"\d+", "#", op.group(1))[-140:] if op else "?"
            else:
                key = f"{_strip(ins.shape)} <- " + ", ".join(_strip(c.shapes.get(o, "?")) for o in ins.operands[:2])
            acc[key][0] += m * f
            acc[key][1] += m
            total += m * f
    return total, unknown, sorted(((f, n, k) for k, (f, n) in acc.items()), reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo")
    ap.add_argument("--by", choices=("op", "shape"), default="op")
    ap.add_argument("--grep", default=None, help="only instructions whose attributes contain this")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.hlo) as f:
        total, unknown, rows = groups(f.read(), args.by, args.grep)
    print(f"total {total:.4g} FLOPs per device; loops with unknown trip counts (counted once): {unknown}")
    for f, n, k in rows[:args.top]:
        print(f"{f:.3e} {100 * f / total:5.1f}%  x{n:<7} {k}")


if __name__ == "__main__":
    main()
