"""`k3 export OUT` — write params in the official K3 checkpoint layout (byte-exact container, index, config).

Either re-export a checkpoint (``--from DIR``: loaded, then written back; byte-identical for an official-layout
input), or export freshly initialised params of a preset (``--preset``). MXFP4 experts use the compressed-tensors
"even" scale rule.

    k3 export out/ --preset k3-mini --seed 0
    k3 export out2/ --from out/ --manifest
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write params as an official-layout safetensors checkpoint",
                       description=__doc__)
    p.add_argument("out", help="output directory (written atomically)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="src", help="checkpoint directory to load and re-export")
    src.add_argument("--preset", help="export freshly initialised params of this preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-format", choices=("mxfp4", "bf16"), default=None)
    p.add_argument("--manifest", action="store_true", help="also write SHA256SUMS")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--strict-config", action="store_true", help="unknown keys in --from's config are errors")
    p.set_defaults(func=run)


def run(args) -> int:
    import jax

    from k3jax.checkpoint.load import load
    from k3jax.checkpoint.save import save

    if args.src:
        # keep experts packed: exporting them again is then a byte copy, not a re-quantization
        cfg, params = load(args.src, keep_experts_packed=args.expert_format in (None, "mxfp4"),
                           strict_config=args.strict_config)
    else:
        from k3jax.config import get_preset
        from k3jax.model import init_params

        cfg = get_preset(args.preset)
        params = init_params(cfg, jax.random.key(args.seed))
    if args.expert_format:
        cfg = cfg.replace(expert_format=args.expert_format)
    r = save(params, cfg, args.out, overwrite=args.overwrite, manifest=args.manifest, progress=True)
    print(f"wrote {r['dir']}: {len(r['files'])} shards, {r['total_size']:,} payload bytes")
    return 0
