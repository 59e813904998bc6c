"""`k3 bench NAME [--json]` — benchmarks that measure the figures an issue names, side by side in one run.

Each benchmark module ``k3jax.bench.<name>`` exposes ``add_arguments(parser)`` (optional) and
``run(args) -> dict``; the dict has at least ``name`` and a ``ratios`` map. With ``--json`` exactly one JSON
object is printed on stdout (progress goes to stderr). A benchmark with targets sets ``ok``; ``ok: false`` (a target
missed) exits 1, with the figures printed anyway.

    k3 bench --list
    k3 bench kda --json
    k3 bench spec --json             # speculative decoding: acceptance and tokens/s with the shipped draft vs without

The Pallas kernels' GPU checks are scripts with their own exit codes, not entries here:
``python -m k3jax.bench.gpu_kda`` and ``python -m k3jax.bench.gpu_mxfp4`` (one JSON object; 0 ok, 1 failed, 2 no GPU).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys

from k3jax.errors import InputError

BENCHES = {
    "kda": "k3jax.bench.kda",
    "mxfp4": "k3jax.bench.mxfp4",
    "moe": "k3jax.bench.moe",
    "load": "k3jax.bench.load",
    "train": "k3jax.bench.train",
    "decode": "k3jax.bench.decode",
    "spec": "k3jax.bench.spec",
    "compile": "k3jax.bench.compile",
    "data": "k3jax.bench.data",
}


def _available() -> list[str]:
    out = []
    for name, mod in BENCHES.items():
        try:
            importlib.util.find_spec(mod)
        except ModuleNotFoundError:
            continue
        if importlib.util.find_spec(mod) is not None:
            out.append(name)
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help="benchmark name (see --list)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list", action="store_true", help="list available benchmarks")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="benchmark-specific options")
    p.set_defaults(func=_main)


def _main(args) -> int:
    # Options of `k3 bench` itself may also come after NAME (`k3 bench kda --json`); REMAINDER would hand them to
    # the benchmark, so take them out here.
    rest = list(args.rest)
    for flag in ("--json", "--list"):
        while flag in rest:
            rest.remove(flag)
            setattr(args, flag[2:], True)
    args.rest = rest
    avail = _available()
    if args.list or not args.name:
        print("\n".join(avail))
        return 0 if args.list else 2
    if args.name not in avail:
        raise InputError(f"unknown benchmark {args.name!r}; available: {', '.join(avail)}")
    mod = importlib.import_module(BENCHES[args.name])
    bp = argparse.ArgumentParser(prog=f"k3 bench {args.name}", allow_abbrev=False)
    if hasattr(mod, "add_arguments"):
        mod.add_arguments(bp)
    bargs = bp.parse_args(args.rest)
    result = mod.run(bargs)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in result.items():
            print(f"{k}: {v}", file=sys.stdout)
    return 1 if result.get("ok") is False else 0  # a bench that checks targets says ok: false when one is missed
