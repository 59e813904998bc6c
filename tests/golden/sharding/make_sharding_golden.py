"""Regenerate the sharding goldens: the PartitionSpec of every ``kimi-k3`` parameter (via ``abstract_params``,
nothing allocated) under two mesh shapes. Diffed by tests/sharding/test_rules.py.

    .venv/bin/python tests/golden/sharding/make_sharding_golden.py
"""

from __future__ import annotations

import json
import os
import sys

GOLDENS = {
    # file stem: (preset, strategy, mesh shape)
    "kimi-k3.ep_tp.d2e8t4": ("kimi-k3", "ep_tp", {"data": 2, "expert": 8, "tensor": 4}),
    "kimi-k3.fsdp_ep_tp.d2f4e32t8": ("kimi-k3", "fsdp_ep_tp", {"data": 2, "fsdp": 4, "expert": 32, "tensor": 8}),
}
HERE = os.path.dirname(os.path.abspath(__file__))


def spec_json(spec) -> list:
    return [list(p) if isinstance(p, tuple) else p for p in spec]


def golden(stem: str) -> dict:
    import jax

    from k3jax.config import get_preset
    from k3jax.pytree import path_str
    from k3jax.sharding.rules import param_specs

    preset, strategy, shape = GOLDENS[stem]
    cfg = get_preset(preset)
    specs = param_specs(cfg, strategy, shape)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    return {"preset": preset, "strategy": strategy, "mesh": shape,
            "specs": {path_str(p): spec_json(s) for p, s in flat[0]}}


def dumps(g: dict) -> str:
    """JSON with one parameter per line (diff-friendly)."""
    head = {k: v for k, v in g.items() if k != "specs"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(g["specs"].items())]
    body = json.dumps(head, sort_keys=True)[:-1]
    return body + ', "specs": {\n' + ",\n".join(lines) + "\n}}\n"


def main() -> int:
    sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..", "..")))
    for stem in GOLDENS:
        with open(os.path.join(HERE, f"{stem}.json"), "w") as f:
            f.write(dumps(golden(stem)))
        print("wrote", stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
