"""Ahead-of-time plans: lower and compile a full-size step for a real target, allocating nothing.

    target = parse_target("tpu:v5p:8x8x8")                # or "tpu:v6e:16x16", "cpu:64" (k3jax.plan.hardware)
    spec = PlanSpec(mode="train", mesh="fsdp=8,expert=64", batch=512, seq_len=4096)  # plan defaults: with_defaults
    check(cfg, target, spec)                              # every input check, before any compile (InputError)
    out = compile_plan(cfg, target, spec)                 # the compiler's figures beside the closed-form estimate

The modes and their defaults are ``k3jax.plan.spec``'s. Targets: ``tpu:<topology>`` runs the TPU compiler through
libtpu's deviceless topologies (``jax.experimental.topologies``; one process at a time holds libtpu); ``cpu:<N>``
runs XLA:CPU over N host devices, which must exist in this process (``k3 plan`` re-runs itself with
``--xla_force_host_platform_device_count=N``).

Figures: per-device argument / output / alias / temp / code bytes from ``compiled.memory_analysis()``; the
closed-form estimate of the argument bytes (``k3jax.plan.estimate``: the config's parameter shapes × the rules'
shardings × the stated bytes per parameter for the mode — not a sum over the lowered program); the collectives and
loop-corrected FLOPs of the compiled HLO (``k3jax.plan.hlo``) against the closed form (``model_flops``:
6 · N_active · tokens and the mode's terms, plus Muon's Newton–Schulz split over the devices — at full size with
the experts trained that is ~1.5x 6·N·tokens of a 262k-token batch); the roofline step time at the chip's published
peaks (``hardware.roofline``: compute from the useful FLOPs and from the compiled program, HBM — split into weights,
activations, kernels and collectives by ``k3jax.plan.hlo_cost`` —, collective bandwidth, the largest of them plus the
collectives' fixed latency, ``collective_latency_s``: a launch and per-hop latency per collective run, from the
slice's torus, ``k3jax.plan.floor.collective_latency``; the compute share) and the bytes floor (``bytes_floor``: the
weights the step's tokens reach, optimizer state, cache and io each touched once, per device, ``k3jax.plan.floor``;
``roofline.over_bytes_floor`` = memory_s / bytes_floor_s). Under expert
parallelism the packed experts run the Pallas kernel on a TPU target (``--packed-kernel``, default auto). A compile
that exceeds HBM raises ``HbmOomError`` carrying the compiler's message and figures. A verify plan (one speculative
step, ``k3jax.plan.verify``) also compiles the decode step on the same mesh and reports the two side by side
(``verify``).
"""

from __future__ import annotations

import re
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax.experimental import mesh_utils

from k3jax.checkpoint.host import peak_rss_bytes
from k3jax.config import K3Config
from k3jax.layers.mla import big_key_block
from k3jax.model import forward
from k3jax.model.cache import advance, cache_shapes, capacity
from k3jax.ops.latent_attention import key_loop_trips
from k3jax.optim.dist_muon import NS_SCOPE, OPTIMIZER_SCOPE
from k3jax.plan.estimate import cache_bytes, estimate_arguments, model_flops
from k3jax.plan.floor import bytes_floor, collective_latency
from k3jax.plan.hardware import Target, roofline, topology_dims
from k3jax.plan.hlo_cost import largest_values, program_stats
from k3jax.plan.spec import (
    CACHED,
    PLAN_REMAT_AUTO,
    SERVING,
    STEP_MODES,
    PlanSpec,
    check,
    plan_params,
    run_settings,
    train_config,
    with_defaults,
)
from k3jax.plan.verify import decode_baseline_spec, verify_program, verify_report
from k3jax.sharding import placement as place
from k3jax.sharding.mesh import MESH_AXES, make_mesh
from k3jax.sharding.rules import param_shardings
from k3jax.train.program import train_step_program
from k3jax.train.settings import optim_config, step_spec


def target_devices(target: Target) -> list:
    if target.platform == "tpu":
        from jax.experimental import topologies  # libtpu's deviceless topologies: a TPU target only

        return list(topologies.get_topology_desc(topology_name=target.topology, platform="tpu").devices)
    devs = jax.devices("cpu")
    if len(devs) != target.devices:
        raise RuntimeError(f"--target {target.spec}: this process has {len(devs)} CPU devices; start it with "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={target.devices}")
    return devs


def _mesh(sizes: dict, devices: list):
    shape = tuple(sizes[a] for a in MESH_AXES)
    if devices[0].platform == "tpu":
        try:  # physical locality: the innermost mesh axes on the nearest chips
            arr = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
            return make_mesh(sizes, devices=arr.reshape(-1))
        except (ValueError, NotImplementedError, AssertionError):
            pass
    return make_mesh(sizes, devices=devices)


def _sds(shapes, shardings):
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def build_program(cfg: K3Config, spec: PlanSpec, mesh, strategy: str):
    """(jitted function, abstract arguments with shardings) of the mode's program on ``mesh``. The train modes
    compile `k3 train`'s step (``k3jax.train.program.train_step_program``) with the plan's settings
    (``spec.train_config``)."""
    spec = with_defaults(spec)[0]
    if spec.remat == "auto":
        raise ValueError("build_program compiles one remat policy; compile_plan resolves 'auto' (auto_remat)")
    run = run_settings(cfg, spec)
    small = spec.mode in STEP_MODES and place.small_batch(strategy, mesh, spec.batch)
    whole = spec.mode in STEP_MODES and place.whole_rows(strategy, mesh, spec.batch)
    dispatch = place.expert_dispatch(strategy, mesh, batch=spec.batch, capacity_factor=spec.capacity_factor,
                                     packed_kernel=run.packed_kernel, replicate_tokens=whole,
                                     cache_rows=whole and not small)
    context = getattr(dispatch, "context", None)               # the sequence split (k3jax/sharding/context_parallel)
    abstract = plan_params(cfg, spec)
    if spec.mode == "verify":
        return verify_program(cfg, spec, mesh, strategy, run=run, params=abstract, dispatch=dispatch, small=small,
                              whole=whole)
    if spec.mode in ("prefill", "decode"):
        return serving_program(cfg, spec, mesh, strategy, run=run, params=abstract, dispatch=dispatch, small=small,
                               whole=whole, context=context)
    if spec.mode == "forward":
        p_sh = param_shardings(cfg, strategy, mesh, abstract)
        tok_sh = place.batch_sharding(strategy, mesh, 2) if context is None else context.sharding(2)
        fn = jax.jit(lambda p, t: forward(p, t, cfg, run, dispatch=dispatch), in_shardings=(p_sh, tok_sh),
                     out_shardings=place.batch_sharding(strategy, mesh, 3) if context is None else context.sharding(3))
        return fn, (_sds(abstract, p_sh), jax.ShapeDtypeStruct((spec.batch, spec.seq_len), jnp.int32,
                                                              sharding=tok_sh))
    tc = train_config(spec)
    ts = train_step_program(cfg, run, optim_config(tc), step_spec(tc), strategy, mesh, abstract, dispatch)
    return ts.step, (_sds(ts.state_shapes, ts.state_sh),            # [1, B, T + 1]: one micro-batch
                     jax.ShapeDtypeStruct((1, spec.batch, spec.seq_len + 1), jnp.int32, sharding=ts.batch_sh),
                     jax.ShapeDtypeStruct((), jnp.float32))


def serving_program(cfg: K3Config, spec: PlanSpec, mesh, strategy: str, *, run, params, dispatch, small: bool,
                    whole: bool | None = None, context=None):
    """Prefill (tokens [B, T] into an empty cache of --context positions) or one decode step ([B, 1] at --context
    keys): ``model.cache.advance`` on the scanned cache layout (the repeating group compiled once) placed by
    ``CACHE_AXES`` under the rules (replicated by the small-batch rule ``small``) and donated, the last token's
    logits out → (jitted fn(params, tokens, cache), abstract arguments). ``whole``: the tokens on every device
    (``placement.whole_rows``; default ``small``). ``params``: the parameter tree (arrays or
    ShapeDtypeStructs), for its shardings. ``context``: a ``ContextParallel`` (a context-parallel prefill: the
    tokens and the latent cache's positions split over its sequence axes)."""
    T = spec.seq_len
    p_sh = param_shardings(cfg, strategy, mesh, params)
    shapes = cache_shapes(cfg, spec.batch, spec.context, run, stacked=True)  # the scanned group: one group compiled
    c_sh = place.cache_shardings(strategy, mesh, shapes, replicated=small, context=context)
    whole = small if whole is None else whole
    tok_sh = place.batch_sharding(strategy, mesh, 2, replicated=whole) if context is None else context.sharding(2)
    decode = spec.mode == "decode"

    def step(p, tokens, cache):
        lengths = jnp.full((spec.batch,), T, jnp.int32)
        return advance(p, tokens, lengths, cache, cfg=cfg, run=run, absorbed=decode, last_only=True,
                       dispatch=dispatch)

    fn = jax.jit(step, in_shardings=(p_sh, tok_sh, c_sh), out_shardings=(None, c_sh), donate_argnums=2)
    return fn, (_sds(params, p_sh), jax.ShapeDtypeStruct((spec.batch, T), jnp.int32, sharding=tok_sh),
                _sds(shapes, c_sh))


def loop_hints(cfg: K3Config, spec: PlanSpec) -> dict[str, int]:
    """Trip counts of the data-dependent loops of a prefill / decode / verify plan (``hlo.hinted_trip_count``): the
    MLA key blocks of a cache filled to what the plan asks — decode: --context keys, read in large blocks; verify:
    --context keys (the piece's last token's), in key blocks; prefill: T keys from an empty cache. Other modes:
    none."""
    if spec.mode not in CACHED:
        return {}
    spec = with_defaults(spec)[0]
    block = run_settings(cfg, spec).mla_block_size
    keys = spec.context if spec.mode in STEP_MODES else spec.seq_len
    return key_loop_trips(keys, block, big_key_block(spec.seq_len, block), capacity(cfg, spec.context,
                                                                                   run_settings(cfg, spec)))


class HbmOomError(RuntimeError):
    """The compiler ran out of device memory: ``figures`` holds what its message states (bytes)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.figures = oom_figures(message)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def oom_figures(message: str) -> dict:
    """``{"used": bytes, "available": bytes}`` from a CompileTimeHbmOomError message ("... (6.03T) exceeds available
    HBM (95.73G)"); the units are XLA's binary multiples."""
    out = {}
    m = re.search(r"\(([\d.]+)([KMGTP]?)\)\s*exceeds available HBM\s*\(([\d.]+)([KMGTP]?)\)", message)
    if m:
        out["used_bytes"] = float(m.group(1)) * _UNITS[m.group(2)]
        out["available_bytes"] = float(m.group(3)) * _UNITS[m.group(4)]
    m = re.search(r"Used ([\d.]+)([KMGTP]?) of ([\d.]+)([KMGTP]?) hbm", message)
    if m and not out:
        out["used_bytes"] = float(m.group(1)) * _UNITS[m.group(2)]
        out["available_bytes"] = float(m.group(3)) * _UNITS[m.group(4)]
    return out


def _is_oom(e: Exception) -> bool:
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s or "HbmOomError" in s or "Ran out of memory" in s


def compile_program(fn, args, log=None) -> tuple[object, dict]:
    """(compiled, {"lower_s", "compile_s"}); a compile that runs out of HBM raises HbmOomError."""
    log = log or (lambda s: None)
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    log(f"lowered in {t1 - t0:.1f} s; compiling ...")
    try:
        compiled = lowered.compile()
    except Exception as e:  # XlaRuntimeError / JaxRuntimeError, depending on the jax version
        if _is_oom(e):
            raise HbmOomError(str(e)) from None
        raise
    t2 = time.perf_counter()
    log(f"compiled in {t2 - t1:.1f} s")
    return compiled, {"lower_s": t1 - t0, "compile_s": t2 - t1}


def compile_plan(cfg: K3Config, target: Target, spec: PlanSpec, log=None, hlo_out: str | None = None, *,
                 decode_baseline: bool = True) -> dict:
    """Compile ``spec``'s program for ``target`` and report (see the module docstring). Raises HbmOomError (with
    ``.plan`` holding everything known before the compile) when the program does not fit. ``hlo_out``: a path
    to write the compiled HLO text to. A verify plan adds ``verify`` (``k3jax.plan.verify.verify_report``), with
    the decode plan on the same mesh compiled in the same run unless ``decode_baseline`` is False. Remat "auto"
    (the train modes' default): ``auto_remat``."""
    log = log or (lambda s: None)
    if with_defaults(spec)[0].remat == "auto":
        return auto_remat(lambda r: compile_plan(cfg, target, replace(spec, remat=r), log, hlo_out,
                                                 decode_baseline=decode_baseline), log)
    t_start = time.perf_counter()
    sizes, strategy = check(cfg, target, spec)
    spec, defaults = with_defaults(replace(spec, platform=target.platform))  # the kernels --kernels picks for it
    est = estimate_arguments(cfg, spec, sizes, strategy)
    mesh = _mesh(sizes, target_devices(target))
    run = run_settings(cfg, spec)
    out = {"preset": cfg.name, "target": target.spec, "platform": target.platform, "devices": target.devices,
           "mesh": place.format_mesh(sizes), "strategy": strategy, "mode": spec.mode, "remat": spec.remat,
           "batch": spec.batch, "seq_len": spec.seq_len, "layer_stack": run.layer_stack, "qat": run.qat,
           "param_dtype": run.param_dtype, "compute_dtype": run.compute_dtype,
           "capacity_factor": spec.capacity_factor, "packed_kernel": run.packed_kernel, "defaults": defaults,
           "opt_state_dtype": spec.opt_state_dtype, "muon_layout": spec.muon_layout,
           "estimated_argument_bytes_per_device": est["total"], "estimate": est}
    if spec.mode in CACHED:
        out["context"] = spec.context
        out["small_batch"] = spec.mode in STEP_MODES and place.small_batch(strategy, sizes, spec.batch)
        out["whole_rows"] = spec.mode in STEP_MODES and place.whole_rows(strategy, sizes, spec.batch)
        out["cache"] = cache_bytes(cfg, spec, sizes, strategy)
    if spec.mode == "verify":
        out.update(draft_tokens=spec.draft_tokens, rollback=spec.rollback)
    cap = target.chip.hbm_bytes if target.chip else None
    out["capacity_bytes_per_device"] = cap
    out["bytes_floor"] = bytes_floor(cfg, spec, sizes, strategy, est=est)
    if spec.mode not in SERVING:
        # the train-state lower bound: master + optimizer state + gradients (activations come on top)
        out["lower_bound_bytes_per_device"] = est["total"] + est["gradient_bytes"]
    log(f"{cfg.name} {spec.mode} on {target.spec}, mesh {out['mesh']} ({strategy}), B={spec.batch} "
        f"T={spec.seq_len}, remat {spec.remat}, capacity factor {spec.capacity_factor}: estimated arguments "
        f"{est['total'] / 1e9:,.2f} GB/device")
    if defaults:
        log("plan defaults used (flags override): " + ", ".join(f"{k} {v}" for k, v in defaults.items()))
    fn, args = build_program(cfg, spec, mesh, strategy)
    try:
        compiled, times = compile_program(fn, args, log)
    except HbmOomError as e:
        out.update({"fits": False, "hbm_oom": e.figures, "compiler_message": str(e),
                    "wall_s": time.perf_counter() - t_start, "peak_rss_bytes": peak_rss_bytes()})
        e.plan = out
        raise
    out.update(times)
    mem = compiled.memory_analysis()
    if mem is not None:
        out.update({"argument_bytes_per_device": int(mem.argument_size_in_bytes),
                    "output_bytes_per_device": int(mem.output_size_in_bytes),
                    "alias_bytes_per_device": int(mem.alias_size_in_bytes),
                    "temp_bytes_per_device": int(mem.temp_size_in_bytes),
                    "code_bytes_per_device": int(mem.generated_code_size_in_bytes)})
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes)
        out["peak_bytes_per_device"] = int(peak)
        out["argument_over_estimate"] = mem.argument_size_in_bytes / est["total"]
        # the TPU compiler enforces its own HBM budget (a program over it fails to compile, HbmOomError) — unless
        # told not to (LIBTPU_INIT_ARGS=--xla_tpu_no_crash_on_oom=true, which compiles it anyway: how a memory
        # report of an over-budget program is had), so the peak is checked against the chip; XLA:CPU has none
        out["fits"] = bool(peak <= cap) if target.platform == "tpu" and cap else None
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    out["cost_analysis"] = {k: float(cost[k]) for k in ("flops", "bytes accessed", "transcendentals")
                            if cost and k in cost}
    text = compiled.as_text()
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(text)
    hints = loop_hints(cfg, spec)
    stats = program_stats(text, hints, scopes=(NS_SCOPE, OPTIMIZER_SCOPE))
    if hints:
        out["loop_hints"] = hints
    out["hlo"] = {**stats.as_dict(), "largest_values": largest_values(text)}
    coll_bytes = sum(v["bytes"] for v in stats.collectives.values())
    out["collectives"] = stats.collectives
    out["collective_bytes_per_device"] = coll_bytes
    mf = model_flops(cfg, spec, sizes, strategy)
    compiled_global = stats.flops * target.devices
    out["flops"] = {**mf, "compiled_per_device": stats.flops, "compiled_global": compiled_global,
                    "compiled_over_expected": compiled_global / mf["expected"],
                    "compiled_over_six_n_tokens": compiled_global / mf["six_n_tokens"]}
    if spec.mode in ("train", "frozen-experts"):  # lora trains its adapters with AdamW: no Newton–Schulz
        # the dot FLOPs the program spends in Muon's Newton–Schulz (its named scope; loops counted as they run),
        # global like newton_schulz_split, and the optimizer update's collectives
        ns = stats.scoped[NS_SCOPE]["flops"] * target.devices
        out["flops"]["newton_schulz_compiled"] = ns
        if mf.get("newton_schulz_split"):
            out["flops"]["newton_schulz_compiled_over_split"] = ns / mf["newton_schulz_split"]
        opt = stats.scoped[OPTIMIZER_SCOPE]["collectives"]
        out["optimizer_collectives"] = {**opt, "bytes": sum(v["bytes"] for v in opt.values())}
    if spec.mode == "train":
        # the check of the train step: the loop-corrected compiled FLOPs within 20% of 6·N_active·tokens
        # (+ one recomputed forward under a remat that saves nothing, + Muon's Newton–Schulz split over the
        # devices); loops with routing-dependent trip counts are counted once (hlo.unknown_trip_counts), so the
        # check is only meaningful where there are none
        out["flops"]["within_20pct_of_expected"] = bool(abs(compiled_global / mf["expected"] - 1) <= 0.2)
    latency = None
    if target.chip is not None:
        latency = collective_latency(text, hints, target.chip, sizes, topology_dims(target))
        out["collective_latency"] = latency
    out["roofline"] = roofline(target.chip, mf["useful"] / target.devices, stats.flops, stats.bytes_accessed,
                               coll_bytes, latency_s=latency["seconds"] if latency else 0.0,
                               floor_bytes=out["bytes_floor"]["total"])
    if out["roofline"] and spec.mode in ("prefill", "decode"):
        r, new = out["roofline"], spec.batch * spec.seq_len
        # one step: a decode step emits one token per row (its latency is the step); prefill's is the first token's
        r["per_token_latency_s" if spec.mode == "decode" else "time_to_first_token_s"] = r["step_s"]
        r["tokens_per_s"] = new / r["step_s"]
        r["tokens_per_s_per_chip"] = new / r["step_s"] / target.devices
    if spec.mode == "verify":  # the tokens it emits depend on the acceptance: out["verify"]
        decode = None
        if decode_baseline:
            log("the decode step on the same mesh (the verify step's baseline; --no-decode-baseline skips it)")
            try:
                decode = compile_plan(cfg, target, decode_baseline_spec(spec), log=log)
            except HbmOomError as e:
                decode = e.plan
        out["verify"] = verify_report(cfg, target, spec, sizes, strategy, out, decode)
    out["wall_s"] = time.perf_counter() - t_start
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def auto_remat(compile_with, log) -> dict:
    """Remat "auto": ``compile_with(policy)`` for each policy of ``PLAN_REMAT_AUTO`` in order ("group", then "full"),
    the first plan that fits the chip (``fits`` not False: off TPU nothing is over budget) is the result; the
    policies tried before it, with their peaks, are in its ``remat_auto``. When none fits, the last one's plan (or its
    HbmOomError) with ``remat_auto``. The choice is by the compiler's own memory, not an estimate: a plan that does
    not fit costs one compile more."""
    tried = []
    for i, policy in enumerate(PLAN_REMAT_AUTO):
        last = i == len(PLAN_REMAT_AUTO) - 1
        log(f"remat auto: compiling with remat {policy}")
        try:
            out = compile_with(policy)
        except HbmOomError as e:
            tried.append({"remat": policy, "fits": False, "peak_bytes_per_device": None,
                          "wall_s": e.plan.get("wall_s")})
            if last:
                e.plan.update(remat_auto={"order": list(PLAN_REMAT_AUTO), "tried": tried, "chosen": None})
                e.plan["defaults"]["remat"] = "auto"
                raise
            log(f"remat auto: {policy} does not fit the chip (the compiler ran out of memory)")
            continue
        tried.append({"remat": policy, "fits": out.get("fits"), "peak_bytes_per_device": out.get(
            "peak_bytes_per_device"), "wall_s": out.get("wall_s")})
        if out.get("fits") is not False or last:
            out["remat_auto"] = {"order": list(PLAN_REMAT_AUTO), "tried": tried,
                                 "chosen": policy if out.get("fits") is not False else None}
            out["defaults"]["remat"] = "auto"
            return out
        log(f"remat auto: {policy} does not fit the chip (peak {out['peak_bytes_per_device'] / 1e9:,.1f} GB)")
    raise AssertionError("unreachable: the last policy returns or raises")


__all__ = ["HbmOomError", "auto_remat", "build_program", "compile_plan", "compile_program", "loop_hints", "oom_figures",
           "serving_program", "target_devices"]
