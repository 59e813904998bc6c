"""`k3 inspect DIR` — validate a checkpoint against its config.json without loading it.

Reports missing / extra tensors and shape / dtype mismatches (exit 2 with a message naming file and tensor), bytes
by dtype, and which modules are stored MXFP4 (decided by the presence of ``weight_packed``). ``--check-data`` also
reads every A_log and E8M0 scale tensor (A_log tail must be 0; scale byte 0xFF = NaN is an error).

    k3 inspect ckpt/
    k3 inspect ckpt/ --json --check-data
"""

from __future__ import annotations

import json
import os
import re


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="validate a checkpoint directory against its config", description=__doc__)
    p.add_argument("dir", help="checkpoint directory (index, shards, config.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--check-data", action="store_true", help="also read A_log and scale tensors and check them")
    p.set_defaults(func=run)


def inspect(path: str, check_data: bool = False) -> dict:
    from k3jax.checkpoint import name_map as nm
    from k3jax.checkpoint.reader import open_checkpoint, validate
    from k3jax.config import from_hf

    ck = open_checkpoint(path)
    cfg = from_hf(os.path.join(path, "config.json"))
    plan = validate(ck, cfg)
    packed = ck.packed_modules()
    out = {
        "dir": os.path.abspath(path), "config": cfg.name, "layout": plan.layout, "valid": True,
        "shards": len(ck.headers), "tensors": len(ck.tensors), "skipped_vision_tensors": len(ck.skipped),
        "bytes_by_dtype": ck.bytes_by_dtype(), "payload_bytes": sum(e.nbytes for e in ck.tensors.values()),
        "index_total_size": ck.total_size, "packed_modules": len(packed),
        "packed_module_kinds": sorted({re.sub(r"\.\d+\.", ".*.", m) for m in packed}),
        "expert_storage": {"/".join(map(str, p)): ("mxfp4" if v else "bf16") for p, v in plan.packed.items()},
    }
    if check_data:
        for spec_entries in plan.leaves.values():
            for s, e in spec_entries:
                if s.part == "scale":
                    ck.read_entry(e)  # counts 0x00 / 0xFF, raises on 0xFF
                elif s.transform == "a_log_pad":
                    nm.from_hf(ck.read_entry(e), s, (cfg.kda_num_heads,))
        out["scale_bytes"] = dict(ck.scale_bytes)
        out["bytes_read"] = ck.bytes_read
    return out


def run(args) -> int:
    out = inspect(args.dir, args.check_data)
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
    return 0
