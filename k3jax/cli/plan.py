"""`k3 plan` — parameters, checkpoint bytes and per-device memory of a preset, without allocating any weights.

    k3 plan --preset kimi-k3                      summary + per-layer table
    k3 plan --preset kimi-k3 --json               the same as one JSON object
    k3 plan --preset kimi-k3 --hardware 8xB300 --hardware 64xH200 --context 131072 --batch 4
    k3 plan --preset kimi-k3 --tensors            name<TAB>dtype<TAB>shape of every text tensor (as tensors.tsv)
    k3 plan --preset kimi-k3 --shards --json      file, bytes, header_len, header_sha256 per text shard
    k3 plan --preset kimi-k3 --compile --target tpu:v5p:8x8x8 --mesh fsdp=8,expert=64 --mode frozen-experts \
            --batch 512 --seq-len 4096 --json                    # the TPU compiler's memory plan (nothing allocated)
    k3 plan --preset kimi-k3 --compile --target cpu:64 --mesh expert=64 --mode train --batch 64 --seq-len 4096
    k3 plan --preset kimi-k3 --compile --target tpu:v5p:4x4x4 --mode decode --batch 1 --context 8192 --json
                                        # no --mesh: the best of the candidate serving meshes (k3jax.plan.layouts)
    k3 plan --preset k3-tiny --compile --target cpu:8 --mode decode --context 64 --compare-layouts
    k3 plan --preset kimi-k3 --compile --target tpu:v5p:4x4x4 --mode verify --draft-tokens 7 --batch 1 \
            --context 8192 --json       # one speculative step (K3 DSpark draft) beside the decode step it replaces

``--compile`` lowers and compiles the full-size program of ``--mode`` (forward: BF16 + packed MXFP4 experts;
train: the QAT fine-tune step; frozen-experts: the step over packed experts) with the rules' shardings and
ShapeDtypeStruct inputs, for a TPU topology through libtpu's deviceless compiler or for XLA:CPU over N simulated
devices (the command re-runs itself with that many), and prints the compiler's per-device bytes beside the
closed-form estimate, the collectives and loop-corrected FLOPs of the compiled program and the roofline step time
(``k3jax.plan.aot``); ``--mode verify`` compiles one speculative step — the target verifying K drafted tokens
with per-token KDA records, the rollback to the accepted prefix (``--rollback copy | replay``) and the draft's next
proposal — and the decode step on the same mesh (``--no-decode-baseline`` skips it) to set the two side by side
(``k3jax.plan.verify``). Exit 1 when the compiler runs out of device memory (its figures are printed), 2 on bad input
(checked before any compile). A plan's defaults are what one deploys at full size: capacity factor 1.25 (dropless
static buffers hold every token routed to one device), remat ``auto`` for the train modes (compiled with ``group``
— the group's backward without a per-layer checkpoint inside it — where that fits the chip, else with ``full``; the
JSON's ``remat_auto`` lists what was tried), and
``zero3_ep_tp`` on a mesh with fsdp and expert axes; the JSON's ``defaults`` lists those a plan used, and the
flags override them. ``--mesh`` is the compile's mesh axes; prefill, decode and verify without it rank a few
candidate meshes and rules columns (decode's, for verify) by a closed-form step time and compile the best
(``--compare-layouts``: every candidate; the JSON's ``layout`` lists them, their estimates and why the chosen one
won); the formula planner's devices are ``--hardware`` (``--mesh 8xB300`` is still read as hardware, with a warning,
for one release).

The counts and the memory model of the formula planner (``k3jax.plan.formula``):
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace

from k3jax.cli.args import KERNELS_HELP, preset_arg, preset_help
from k3jax.config import KERNELS, get_preset
from k3jax.errors import InputError
from k3jax.plan import aot, formula, layouts
from k3jax.plan.formula import DEFAULT_CONTEXT, build_plan, shard_rows, specs_with_fallback
from k3jax.plan.hardware import DEFAULT_HARDWARE, GPU_BYTES, parse_target, xla_flags
from k3jax.plan.spec import PLAN_DRAFT_TOKENS, PlanSpec, check


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="parameters, checkpoint bytes and per-device memory (allocates nothing)",
                       description=__doc__ + "\n" + formula.__doc__.split("\n\n", 2)[2],  # its counts, memory model
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, type=preset_arg, metavar="NAME", help=preset_help("the model to plan"))
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--tensors", action="store_true", help="list every text tensor of the official layout, in order")
    p.add_argument("--shards", action="store_true", help="list the text shards: file size, header length, sha256")
    p.add_argument("--hardware", action="append", default=None, metavar="NAME",
                   help=f"devices of the formula planner like 8xB300 (repeatable; default {' '.join(DEFAULT_HARDWARE)})"
                        f"; known GPUs: {', '.join(GPU_BYTES)}")
    p.add_argument("--mesh", action="append", default=None, metavar="AXES",
                   help="mesh axes of --compile, e.g. fsdp=8,expert=64 (the product = the target's devices); "
                        "context=N splits the sequence (a batch smaller than the token axes lends them to it)")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence for the caches (formula planner: "
                   f"default {DEFAULT_CONTEXT:,}); --compile --mode decode: the keys each row attends to (the cache "
                   "holds context - 1), --mode prefill: the cache's length (default --seq-len)")
    p.add_argument("--batch", type=int, default=None, help="sequences: for the caches (default 1), or the "
                   "global batch of --compile (default 1)")
    c = p.add_argument_group("--compile (ahead-of-time plan on a real compiler)")
    c.add_argument("--compile", action="store_true", help="lower and compile the full-size program")
    c.add_argument("--target", default=None, help="tpu:v5p:8x8x8, tpu:v6e:16x16, tpu:v5e:16x16 or cpu:<devices>")
    c.add_argument("--mode", default="forward", help="forward (default), train, frozen-experts, lora (the QLoRA step: "
                   "adapters on every target over a BF16 base with packed MXFP4 experts), prefill (the forward "
                   "with the cache written), decode (one step at --context) or verify (one speculative step at "
                   "--context: K drafted tokens verified, rolled back to the accepted ones, K more drafted)")
    c.add_argument("--draft-tokens", type=int, default=None, metavar="K", help="--mode verify: tokens the draft "
                   "proposes per step (default 7, the K3 DSpark draft's block; the piece verified is K + 1)")
    c.add_argument("--rollback", default=None, help="--mode verify: copy (default: the KDA state after every token "
                   "of the piece kept) or replay (the per-token updates kept and summed back)")
    c.add_argument("--no-decode-baseline", action="store_true", help="--mode verify: do not compile the decode "
                   "step on the same mesh (the JSON's verify.decode_step_s and step_ratio are then null)")
    c.add_argument("--lora-rank", type=int, default=None, help="--mode lora: the adapters' rank (default 16)")
    c.add_argument("--lora", default=None, metavar="SPEC", help="--mode lora: the adapters as k3 train --lora "
                   "takes them (rank=, alpha=, targets=, dropout=, experts_shared_a=true), over the plan's defaults "
                   "(rank 16 or --lora-rank, alpha 2 x rank, every target)")
    c.add_argument("--remat", default=None, help="remat policy of the train modes (auto, none, full, group, "
                   "dots_saveable, ...; default auto: group where it fits the chip, else full — one compile more "
                   "when group does not fit; serving modes: none)")
    c.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096; decode: 1; "
                   "verify: --draft-tokens + 1)")
    c.add_argument("--strategy", default=None, help="rules column (default: zero3_ep_tp on a mesh with fsdp and "
                   "expert axes, otherwise the mesh axes' default)")
    c.add_argument("--compare-layouts", action="store_true", help="--mode decode / prefill without --mesh: compile "
                   "every candidate mesh, not only the best by the closed-form estimate")
    c.add_argument("--hlo-out", default=None, metavar="PATH", help="write the compiled program's HLO text here")
    c.add_argument("--capacity-factor", type=float, default=None,
                   help="expert-parallel bucket size over the balanced load (default 1.25; -1: worst case, dropless)")
    c.add_argument("--opt-state-dtype", default=None, help="train modes: the optimizer moments' dtype (float32 or "
                   "bfloat16; default bfloat16 for --mode train, float32 for frozen-experts; fp32 master weights "
                   "either way)")
    c.add_argument("--muon-layout", default=None, choices=("owner", "layer"),
                   help="train modes: where Muon's Newton-Schulz runs: owner (default: each block whole on one "
                        "device) or layer (one layer at a time, where the rules put it)")
    c.add_argument("--packed-kernel", default=None, help="who runs the packed MXFP4 experts under expert "
                   "parallelism: auto (the Pallas kernel on GPU/TPU), pallas, or tiles (the XLA loop); default: as "
                   "--kernels picks")
    c.add_argument("--kernels", choices=KERNELS, default="auto", help=KERNELS_HELP.format(ops="--packed-kernel"))
    p.set_defaults(func=_main)


# ------------------------------------------------------------------------------------------------------ output

def _g(n: int) -> str:
    return f"{n / 1e9:,.3f} B" if n >= 1e8 else f"{n / 1e6:,.3f} M"


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB"


def _print_plan(p: dict, out) -> None:
    w = out.write
    w(f"preset {p['preset']}  layout {p['layout']}  experts {p['expert_format']}\n")
    w(f"total params       {p['total_params']:>22,}  ({_g(p['total_params'])}; {p['total_params_note']})\n")
    w(f"checkpoint params  {p['checkpoint_params']:>22,}  ({p['checkpoint_params_note']})\n")
    w(f"active params      {p['active_params']:>22,}  ({_g(p['active_params'])}; {p['active_params_note']})\n")
    w(f"checkpoint bytes   {p['checkpoint_bytes']:>22,}  ({p['checkpoint_bytes'] / 2**30:,.2f} GiB, "
      f"{p['checkpoint_tensors']:,} text tensors)\n")
    for k, v in p["bytes_by_dtype"].items():
        w(f"  {k:<5} {p['tensors_by_dtype'][k]:>9,} tensors {v:>22,} bytes\n")
    w("components (params / active):\n")
    for k, v in p["components"].items():
        w(f"  {k:<20} {v['params']:>22,} {v['active']:>22,}\n")
    for n in p.get("notes", []):
        w(f"note: {n}\n")
    w(f"\n{'layer':>5} {'attn':>4} {'ffn':>5} {'params':>18} {'active':>18} {'bytes':>18}\n")
    for r in p["layers"]:
        w(f"{r['layer']:>5} {r['attention']:>4} {r['ffn']:>5} {r['params']:>18,} {r['active']:>18,} "
          f"{r['bytes']:>18,}\n")
    m = p["model_level"]
    w(f"{'model':>5} {'':>4} {'':>5} {m['params']:>18,} {m['active']:>18,} {m['bytes']:>18,}\n")
    mem = p["memory"]
    fixed = mem["kda_state_bytes_per_sequence"] + mem["kda_conv_bytes_per_sequence"]
    w(f"\ncache per sequence at {mem['context_1m']:,} tokens (MLA values bf16, KDA state and conv fp32):\n")
    w(f"  latent (absorbed MLA) {_gb(mem['cache_bytes_per_sequence_at_1m']):>12}  = KDA {_gb(fixed)} fixed + "
      f"MLA {mem['mla_cache_bytes_per_token']:,} B/token\n")
    w(f"  plain KV (per head)   {_gb(mem['plain_kv_cache_bytes_per_sequence_at_1m']):>12}  = KDA {_gb(fixed)} fixed + "
      f"MLA {mem['plain_kv_cache_bytes_per_token']:,} B/token  "
      f"({mem['plain_kv_over_latent_cache_at_1m']:.1f}x the latent cache)\n")
    w(f"\nmemory per device at context {mem['context']:,}, batch {mem['batch']}:\n")
    for a in mem["assumptions"]:
        w(f"  assumption: {a}\n")
    w(f"  {'mesh':<9} {'weights':>12} {'kda state':>12} {'mla cache':>12} {'total':>12} {'device':>10} fits\n")
    for r in mem["meshes"]:
        w(f"  {r['mesh']:<9} {_gb(r['weights_bytes']):>12} {_gb(r['kda_state_bytes']):>12} "
          f"{_gb(r['mla_cache_bytes']):>12} {_gb(r['total_bytes']):>12} {_gb(r['device_bytes']):>10} "
          f"{'yes' if r['fits'] else 'NO'}\n")


def _hardware(args) -> tuple[str, ...]:
    """--hardware values, and --mesh values of the old hardware form (NxGPU), deprecated: read with a warning."""
    hw = list(args.hardware or [])
    for m in args.mesh or []:
        if "=" in m:
            raise InputError(f"--mesh {m}: mesh axes are for --compile (the formula planner takes --hardware NxGPU)")
        print(f"k3 plan: warning: --mesh {m} names hardware; use --hardware {m} (the old spelling goes away in the "
              "next release)", file=sys.stderr)
        hw.append(m)
    return tuple(hw or DEFAULT_HARDWARE)


_CHILD_ENV = "K3_PLAN_CPU_DEVICES"


def _compile_argv(args) -> list[str]:
    argv = ["plan", "--preset", args.preset, "--compile", "--target", args.target, "--mode", args.mode,
            "--batch", str(args.batch or 1), *(["--mesh", args.mesh[0]] if args.mesh else []),
            *(["--compare-layouts"] if args.compare_layouts else []),
            *(["--no-decode-baseline"] if args.no_decode_baseline else [])]
    for flag, v in (("--seq-len", args.seq_len), ("--remat", args.remat), ("--capacity-factor", args.capacity_factor),
                    ("--strategy", args.strategy), ("--packed-kernel", args.packed_kernel), ("--kernels", args.kernels),
                    ("--context", args.context), ("--opt-state-dtype", args.opt_state_dtype),
                    ("--muon-layout", args.muon_layout), ("--lora-rank", args.lora_rank), ("--lora", args.lora),
                    ("--draft-tokens", args.draft_tokens), ("--rollback", args.rollback)):
        if v is not None:
            argv += [flag, str(v)]
    if args.hlo_out:
        argv += ["--hlo-out", args.hlo_out]
    return argv + (["--json"] if args.json else [])


def _respawn_cpu(args, n: int) -> int:
    """Run this plan in a child process whose XLA:CPU has ``n`` devices (XLA reads the count once, at start)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(n), JAX_PLATFORMS="cpu", **{_CHILD_ENV: str(n)})
    return subprocess.run([sys.executable, "-m", "k3jax.cli.main", *_compile_argv(args)], env=env).returncode


def _compile(args, cfg) -> int:
    if not args.target:
        raise InputError("--compile needs --target (tpu:v5p:8x8x8, tpu:v6e:16x16 or cpu:<devices>)")
    if args.mesh and len(args.mesh) > 1:
        raise InputError("--compile takes one --mesh, e.g. --mesh fsdp=8,expert=64")
    if not args.mesh and args.mode not in layouts.LAYOUT_MODES:
        raise InputError(f"--compile needs one --mesh with --mode {args.mode}, e.g. --mesh fsdp=8,expert=64 (--mode "
                         f"{' / '.join(layouts.LAYOUT_MODES)} choose one without it)")
    if args.compare_layouts and args.mesh:
        raise InputError("--compare-layouts compares the candidate meshes of a plan without --mesh; drop one")
    if args.compare_layouts and args.strategy:
        raise InputError("--compare-layouts compares candidate rules columns; drop --strategy")
    if args.hardware:
        raise InputError("--hardware is the formula planner's; --compile takes --target")
    if args.no_decode_baseline and args.mode != "verify":
        raise InputError(f"--no-decode-baseline: a verify plan's; --mode {args.mode} compiles no baseline")
    target = parse_target(args.target)
    K = PLAN_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens
    seq_len = args.seq_len if args.seq_len is not None else {"decode": 1, "verify": K + 1}.get(args.mode, 4096)
    spec = PlanSpec(mode=args.mode, mesh=args.mesh[0] if args.mesh else None, batch=args.batch or 1,
                    seq_len=seq_len, remat=args.remat,
                    capacity_factor=args.capacity_factor, strategy=args.strategy,
                    packed_kernel=args.packed_kernel, kernels=args.kernels, platform=target.platform,
                    context=args.context,
                    opt_state_dtype=args.opt_state_dtype, muon_layout=args.muon_layout or "owner",
                    lora_rank=16 if args.lora_rank is None else args.lora_rank, lora=args.lora or "",
                    draft_tokens=args.draft_tokens, rollback=args.rollback)
    layout = None
    if spec.mesh is None:  # the serving modes: the best candidate by the closed-form estimate (k3jax.plan.layouts)
        if args.strategy:
            raise InputError("--strategy without --mesh: the candidate meshes come with their rules columns; give "
                             "--mesh too")
        layout = layouts.choose_layout(cfg, target, spec)
        spec = replace(spec, mesh=layout["chosen"]["mesh"], strategy=layout["chosen"]["strategy"])
    check(cfg, target, spec)  # every input check before a child process or a compile
    if target.platform == "cpu" and os.environ.get(_CHILD_ENV) != str(target.devices):
        return _respawn_cpu(args, target.devices)
    log = lambda s: print(f"k3 plan: {s}", file=sys.stderr, flush=True)  # noqa: E731
    if layout:
        log(f"mesh {spec.mesh} ({spec.strategy}): {layout['why']}")
    out, rc = _compile_one(cfg, target, spec, log, args.hlo_out, decode_baseline=not args.no_decode_baseline)
    if layout and args.compare_layouts:
        for row in layout["candidates"]:
            if row["estimate_s"] is None:
                continue
            if (row["mesh"], row["strategy"]) == (spec.mesh, spec.strategy):
                row["compiled"] = _compiled_summary(out)
                continue
            log(f"--compare-layouts: {row['mesh']} ({row['strategy']})")
            other = replace(spec, mesh=row["mesh"], strategy=row["strategy"])
            row["compiled"] = _compiled_summary(_compile_one(cfg, target, other, log, None,
                                                             decode_baseline=False)[0])
    if layout:
        out["layout"] = layout
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_compiled(out, sys.stdout)
        if layout:
            _print_layout(layout, sys.stdout)
    return rc


def _compile_one(cfg, target, spec, log, hlo_out, decode_baseline: bool = True) -> tuple[dict, int]:
    """(the plan's figures, exit code: 1 when the compiler ran out of device memory)."""
    try:
        out = aot.compile_plan(cfg, target, spec, log=log, hlo_out=hlo_out, decode_baseline=decode_baseline)
    except aot.HbmOomError as e:
        return e.plan, 1
    return out, 1 if out.get("fits") is False else 0


def _compiled_summary(p: dict) -> dict:
    """What ``--compare-layouts`` keeps of a candidate's compiled plan."""
    r = p.get("roofline") or {}
    keep = {k: p[k] for k in ("fits", "peak_bytes_per_device", "compile_s") if k in p}
    return {**keep, **{k: r[k] for k in ("step_s", "bound", "memory_s", "collective_latency_s") if k in r}}


def _print_layout(layout: dict, out) -> None:
    w = out.write
    w(f"  layout: {layout['chosen']['mesh']} ({layout['chosen']['strategy']}) — {layout['why']}\n")
    for r in layout["candidates"]:
        est = "cannot place: " + r["error"][:160] if r["estimate_s"] is None else (
            f"estimate {r['estimate_s'] * 1e3:,.2f} ms ({r['bytes_per_device'] / 1e9:,.2f} GB/chip"
            f"{'' if r['fits_estimate'] else ', arguments over HBM'})")
        c = r.get("compiled")
        comp = "" if not c else (f"; compiled: {c['step_s'] * 1e3:,.2f} ms" if "step_s" in c
                                 else f"; compiled: fits {c.get('fits')}")
        w(f"    {r['mesh']:<22} {r['strategy']:<6} {est}{comp}\n")


def _print_compiled(p: dict, out) -> None:
    w = out.write
    w(f"{p['preset']} {p['mode']} on {p['target']} ({p['devices']} devices), mesh {p['mesh']} ({p['strategy']}), "
      f"B={p['batch']} T={p['seq_len']}, remat {p['remat']}, QAT {p['qat']}, {p['layer_stack']} stack\n")
    if "remat_auto" in p:
        w("  remat auto: " + "; ".join(f"{t['remat']} " + ("fits" if t["fits"] is not False else "does not fit")
                                      + (f" ({t['peak_bytes_per_device'] / 1e9:,.1f} GB peak)"
                                         if t["peak_bytes_per_device"] else "") for t in p["remat_auto"]["tried"])
          + "\n")
    if "cache" in p:
        c = p["cache"]
        rule = " (small-batch rule: replicated)" if p["small_batch"] else \
            " (rows split; every row's tokens on every chip)" if p.get("whole_rows") else ""
        w(f"  cache at context {p['context']:,}{rule}: "
          f"{c['per_device'] / 1e9:,.2f} GB/device (KDA {c['kda_per_device'] / 1e9:,.2f}, MLA latent "
          f"{c['mla_per_device'] / 1e9:,.2f}), {c['global'] / 1e9:,.2f} GB in all\n")
    cap = p.get("capacity_bytes_per_device")
    if "hbm_oom" in p:
        f = p["hbm_oom"]
        w(f"  OUT OF DEVICE MEMORY: the compiler needs {f.get('used_bytes', float('nan')) / 1e9:,.2f} GB of "
          f"{f.get('available_bytes', float('nan')) / 1e9:,.2f} GB\n  {p['compiler_message'][:400]}\n")
    for k in ("argument", "output", "alias", "temp", "code", "peak"):
        if f"{k}_bytes_per_device" in p:
            w(f"  {k:<9} {p[f'{k}_bytes_per_device'] / 1e9:>12,.2f} GB/device\n")
    w(f"  estimated arguments {p['estimated_argument_bytes_per_device'] / 1e9:,.2f} GB/device"
      + (f" (compiled / estimate {p['argument_over_estimate']:.3f})" if "argument_over_estimate" in p else "")
      + "\n")
    if "lower_bound_bytes_per_device" in p:
        w(f"  train-state lower bound (weights + optimizer + gradients) {p['lower_bound_bytes_per_device'] / 1e9:,.2f}"
          " GB/device\n")
    if cap:
        w(f"  capacity {cap / 1e9:,.0f} GB/device; fits: {p.get('fits')}\n")
    for kind, v in p.get("collectives", {}).items():
        w(f"  {kind:<20} {v['count']:>8,} per step {v['bytes'] / 1e9:>12,.3f} GB/device\n")
    h = p.get("hlo", {})
    if h.get("hbm_bytes_split"):
        w("  HBM bytes/device: " + ", ".join(f"{k} {v / 1e9:,.2f} GB" for k, v in h["hbm_bytes_split"].items())
          + "\n")
    for name, k in h.get("kernels", {}).items():
        w(f"  kernel {name}: {k['count']:,} calls, {k['flops']:.4g} FLOPs, {k['bytes'] / 1e9:,.2f} GB"
          f"{'' if k['estimated'] else ' (no cost estimate: operands + result)'}\n")
    if "flops" in p:
        f = p["flops"]
        w(f"  flops {f['compiled_global']:.4g} compiled (global, loop-corrected) vs {f['expected']:.4g} expected "
          f"(6·N_active·tokens = {f['six_n_tokens']:.4g}, Newton–Schulz split over the devices "
          f"{f.get('newton_schulz_split', 0):.4g}); ratio {f['compiled_over_expected']:.3f}\n")
    r = p.get("roofline")
    if r:
        w(f"  roofline on {r['chip']}: compute {r['compute_s']:.3f} s useful, {r['compiled_compute_s']:.3f} s "
          f"compiled; HBM {r['memory_s']:.3f} s, collectives {r['collective_s']:.3f} s + latency "
          f"{r['collective_latency_s'] * 1e3:,.2f} ms -> {r['step_s']:.3f} s/step ({r['bound']}-bound, compute share "
          f"{r['compute_share'] or 0:.2f})\n")
        if r.get("bytes_floor_s"):
            w(f"  bytes floor {p['bytes_floor']['total'] / 1e9:,.2f} GB/device -> {r['bytes_floor_s']:.3f} s; HBM "
              f"traffic {r['over_bytes_floor'] or 0:.1f}x the floor\n")
        if "tokens_per_s_per_chip" in r:
            lat = r.get("per_token_latency_s", r.get("time_to_first_token_s"))
            w(f"  {'per-token latency' if 'per_token_latency_s' in r else 'time to first token'} {lat * 1e3:,.2f} ms; "
              f"{r['tokens_per_s']:,.1f} tokens/s, {r['tokens_per_s_per_chip']:,.2f} tokens/s per chip\n")
    if "verify" in p:
        _print_verify(p["verify"], w)
    if "compile_s" in p:
        w(f"  lower {p['lower_s']:.1f} s, compile {p['compile_s']:.1f} s, wall {p['wall_s']:.1f} s, "
          f"peak RSS {p['peak_rss_bytes'] / 2**30:.2f} GiB\n")


def _print_verify(v: dict, w) -> None:
    ms = lambda x: "n/a" if x is None else f"{x * 1e3:,.2f} ms"  # noqa: E731
    w(f"  verify: K={v['draft_tokens']} ({v['rollback']} rollback), step {ms(v['step_s'])} vs decode "
      f"{ms(v['decode_step_s'])} (closed form {ms(v['estimate_step_s'])} vs {ms(v['decode_estimate_step_s'])})\n")
    w(f"  implied speedup ({v['basis']}): "
      + ", ".join(f"{a} tokens/verify {x:.2f}x" for a, x in v["implied_speedup"].items()) + "\n")
    r = v["rollback_bytes_per_chip"]
    w(f"  rollback records per chip: copy {r['copy'] / 2**30:,.3f} GiB, replay {r['replay'] / 2**30:,.3f} GiB; draft "
      f"{v['draft_params'] / 1e9:,.3f} B params, {v['draft_params_bytes_per_chip'] / 1e9:,.2f} GB/chip\n")
    pub = v["published"]
    w(f"  published: {pub['copy_rollback_gib_per_rank']} GiB per rank ({pub['measures']}); {pub['how_they_differ']}\n")


def _main(args) -> int:
    cfg = get_preset(args.preset)
    if args.compile:
        return _compile(args, cfg)
    for flag, given in (("--target", args.target), ("--mode", args.mode != "forward"), ("--seq-len", args.seq_len),
                        ("--remat", args.remat), ("--strategy", args.strategy),
                        ("--capacity-factor", args.capacity_factor), ("--hlo-out", args.hlo_out),
                        ("--packed-kernel", args.packed_kernel), ("--opt-state-dtype", args.opt_state_dtype),
                        ("--muon-layout", args.muon_layout), ("--lora-rank", args.lora_rank),
                        ("--lora", args.lora), ("--kernels", args.kernels != "auto"),
                        ("--compare-layouts", args.compare_layouts),
                        ("--draft-tokens", args.draft_tokens), ("--rollback", args.rollback),
                        ("--no-decode-baseline", args.no_decode_baseline)):
        if given is not None and given is not False:
            raise InputError(f"{flag} applies to --compile")
    out = sys.stdout
    if args.tensors:
        specs, _, _ = specs_with_fallback(cfg)
        if args.json:
            json.dump([{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs], out)
            out.write("\n")
        else:
            out.write("name\tdtype\tshape\n")
            out.writelines(f"{s.name}\t{s.dtype}\t{','.join(map(str, s.shape))}\n" for s in specs)
        return 0
    if args.shards:
        rows = shard_rows(cfg)
        if args.json:
            json.dump(rows, out, indent=1)
            out.write("\n")
        else:
            out.write("file\tbytes\theader_len\theader_sha256\ttensors\n")
            out.writelines(f"{r['file']}\t{r['bytes']}\t{r['header_len']}\t{r['header_sha256']}\t{r['tensors']}\n"
                           for r in rows)
        return 0
    context = DEFAULT_CONTEXT if args.context is None else args.context
    plan = build_plan(cfg, _hardware(args), context, 1 if args.batch is None else args.batch)
    if args.json:
        json.dump(plan, out, indent=1)
        out.write("\n")
    else:
        _print_plan(plan, out)
    return 0
