"""`k3 inspect DIR` — validate a checkpoint against its config.json without loading it.

Reports missing / extra tensors and shape / dtype mismatches (exit 2 with a message naming file and tensor), bytes
by dtype, which modules are stored MXFP4 (decided by the presence of ``weight_packed``), and what it tolerated from
other writers: config keys it ignored or checked (transformers' derived keys), floating tensors stored in another
float dtype (cast on load), ``A_log`` in another vector form, a dense MLP under transformers 5's ``block_sparse_moe.``
name. Every ``A_log`` is read (a few hundred bytes per layer) to check that its padding is exactly 0.
``--check-data`` also reads every E8M0 scale tensor (byte 0xFF = NaN is an error).

    k3 inspect ckpt/
    k3 inspect ckpt/ --json --check-data --strict-config
"""

from __future__ import annotations

import argparse
import json
import os
import re

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.io import open_checkpoint
from k3jax.checkpoint.plan import A_LOG_TRANSFORMS, plan_load
from k3jax.cli.args import add_checkpoint_dir, add_strict_config, checkpoint_dir
from k3jax.config import from_hf
from k3jax.errors import InputError


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="validate a checkpoint directory against its config", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_dir(p, "checkpoint directory (index, shards, config.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check-data", action="store_true", help="also read every E8M0 scale tensor and check it")
    add_strict_config(p)
    p.set_defaults(func=run)


def inspect(path: str, check_data: bool = False, strict_config: bool = False) -> dict:
    ck = open_checkpoint(path)
    report: dict = {}
    cfg = from_hf(os.path.join(path, "config.json"), strict=strict_config, report=report)
    plan = plan_load(ck, cfg)
    for spec_entries in plan.leaves.values():
        for s, e in spec_entries:
            if s.transform in A_LOG_TRANSFORMS:
                try:
                    nm.leaf_from_hf(ck.read_entry(e), s, (cfg.kda_num_heads,))
                except InputError as err:
                    raise CheckpointError(str(err).removeprefix(f"{s.name}: "), file=e.file, tensor=s.name) from None
            elif check_data and s.part == "scale":
                ck.read_entry(e)  # counts 0x00 / 0xFF, raises on 0xFF
    packed = ck.packed_modules()
    out = {
        "dir": os.path.abspath(path), "config": cfg.name, "layout": plan.layout, "valid": True,
        "shards": len(ck.headers), "tensors": len(ck.tensors), "skipped_vision_tensors": len(ck.skipped),
        "bytes_by_dtype": ck.bytes_by_dtype(), "payload_bytes": sum(e.nbytes for e in ck.tensors.values()),
        "index_total_size": ck.total_size, "packed_modules": len(packed),
        "packed_module_kinds": sorted({re.sub(r"\.\d+\.", ".*.", m) for m in packed}),
        "expert_storage": {"/".join(map(str, p)): ("mxfp4" if v else "bf16") for p, v in plan.packed.items()},
        "tolerated": plan.tolerated(report),
    }
    if check_data:
        out["scale_bytes"] = dict(ck.scale_bytes)
    out["bytes_read"] = ck.bytes_read
    return out


def tolerated_lines(t: dict) -> list[str]:
    """Human-readable lines for ``inspect(...)["tolerated"]`` (empty when the checkpoint is in release form)."""
    lines = []
    for conv, n in t.get("casts", {}).items():
        src, dst = conv.split("->")
        lines.append(f"cast {n} {src} tensor{'s' * (n != 1)} to {dst} (stored {src}; the release stores {dst})")
    if "a_log_form" in t:
        forms = t["a_log_form"]
        lines.append(f"A_log stored {forms if isinstance(forms, str) else ', '.join(forms)}")
    for form, layers in t.get("dense_mlp_names", {}).items():
        lines.append(f"dense MLP of layer{'s' * (len(layers) != 1)} {', '.join(map(str, layers))} named "
                     f"{form}.{{gate,up,down}}_proj (transformers 5; the release names it mlp.*)")
    if t.get("ignored_keys"):
        lines.append(f"ignored keys (irrelevant to the math): {', '.join(t['ignored_keys'])}")
    if t.get("derived_keys"):
        lines.append(f"derived keys (checked to agree with the keys used): {', '.join(t['derived_keys'])}")
    if t.get("unknown_keys"):
        lines.append(f"ignored unknown keys: {', '.join(t['unknown_keys'])}")
    return lines


def run(args) -> int:
    out = inspect(checkpoint_dir(args), args.check_data, args.strict_config)
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"{out['dir']}: valid {out['layout']} checkpoint for {out['config']!r}: {out['tensors']} tensors in "
          f"{out['shards']} shards, {out['payload_bytes']:,} payload bytes")
    for k, v in sorted(out["bytes_by_dtype"].items()):
        print(f"  {k:5s} {v:>20,} bytes")
    print(f"  MXFP4 (weight_packed) modules: {out['packed_modules']}  {', '.join(out['packed_module_kinds'])}")
    if "scale_bytes" in out:
        print(f"  E8M0 scale bytes: {out['scale_bytes']}")
    lines = tolerated_lines(out["tolerated"])
    print("  tolerated: " + ("nothing (release form)" if not lines else lines[0]))
    for line in lines[1:]:
        print(f"             {line}")
    return 0
