"""Ahead-of-time plans: lower and compile a full-size step for a real target, allocating nothing.

    target = parse_target("tpu:v5p:8x8x8")                # or "tpu:v6e:16x16", "cpu:64"
    spec = PlanSpec(mode="train", mesh="fsdp=8,expert=64", batch=512, seq_len=4096)  # plan defaults: with_defaults
    check(cfg, target, spec)                              # every input check, before any compile (ValueError)
    out = compile_plan(cfg, target, spec)                 # the compiler's figures beside the closed-form estimate

Modes (each the program a user runs, with the rules table's shardings and the expert-parallel dispatch when the
rules shard the experts; the layer stack scanned):
    forward         serving prefill in the stored form: BF16 weights, routed experts as packed MXFP4 bytes,
                    tokens [B, T] → logits [B, T, V] (f32)
    train           the QAT fine-tune step (``k3jax.train.step``): fp32 master weights, per-head Muon / AdamW state,
                    QAT weights+acts (MXFP4 expert weights, MXFP8 expert inputs), QB, QK-Clip; tokens [1, B, T+1]
    frozen-experts  the same step with the routed experts frozen as packed MXFP4 bytes (``k3 train
                    --frozen-experts``): no expert master weights, gradients or optimizer state; QAT of the expert
                    inputs (``qat="weights+acts"`` over packed experts quantizes the activations only)

Targets: ``tpu:<topology>`` runs the TPU compiler through libtpu's deviceless topologies (``jax.experimental.
topologies``; one process at a time holds libtpu); ``cpu:<N>`` runs XLA:CPU over N host devices, which must exist
in this process (``k3 plan`` re-runs itself with ``--xla_force_host_platform_device_count=N``).

Figures: per-device argument / output / alias / temp / code bytes from ``compiled.memory_analysis()``; the
closed-form estimate of the argument bytes (``estimate_arguments``: the config's parameter shapes × the rules'
shardings × the stated bytes per parameter for the mode — not a sum over the lowered program); the collectives and
loop-corrected FLOPs of the compiled HLO (``k3jax.analysis.hlo``) against the closed form (``model_flops``:
6 · N_active · tokens and the mode's terms, plus Muon's Newton–Schulz split over the devices — at full size with
the experts trained that is ~1.5x 6·N·tokens of a 262k-token batch); the roofline step time at the chip's published
peak. A compile that exceeds HBM raises ``HbmOomError`` carrying the compiler's message and figures.
"""

from __future__ import annotations

import importlib.util
import math
import re
import resource
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import REMAT_POLICIES, K3Config, default_run
from k3jax.pytree import key_names

MODES = ("forward", "train", "frozen-experts")


@dataclass(frozen=True)
class Chip:
    """Published per-chip figures (Cloud TPU docs: the v5p, v6e and v5e pages), in bytes and bytes/s. v5p's HBM is
    the docs' table figure, 95 GiB (its compiler reports 95.73 GiB available); v6e 32 GB, v5e 16 GB."""

    name: str
    hbm_bytes: float
    peak_flops: float  # bf16 dense
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s, bidirectional, all links of one chip


CHIPS = {
    "v5p": Chip("TPU v5p", 95 * 2**30, 459e12, 2765e9, 1200e9),
    "v6e": Chip("TPU v6e", 32e9, 918e12, 1638e9, 800e9),
    "v5e": Chip("TPU v5e", 16e9, 197e12, 819e9, 400e9),
}


@dataclass(frozen=True)
class Target:
    spec: str
    platform: str  # "tpu" | "cpu"
    topology: str | None
    devices: int
    chip: Chip | None


def parse_target(s: str) -> Target:
    """``tpu:v5p:8x8x8`` / ``tpu:v6e:16x16`` / ``tpu:v5e:16x16`` / ``cpu:64``. Errors name the value."""
    parts = s.split(":")
    if parts[0] == "cpu" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) >= 1:
        return Target(s, "cpu", None, int(parts[1]), None)
    if parts[0] == "tpu" and len(parts) == 3 and parts[1] in CHIPS and re.fullmatch(r"\d+(x\d+){1,2}", parts[2]):
        dims = [int(d) for d in parts[2].split("x")]
        if min(dims) >= 1:
            return Target(s, "tpu", f"{parts[1]}:{parts[2]}", math.prod(dims), CHIPS[parts[1]])
    raise ValueError(f"--target {s!r}: unknown target; use tpu:<chip>:<topology> with chip one of "
                     f"{', '.join(CHIPS)} (e.g. tpu:v5p:8x8x8, tpu:v6e:16x16) or cpu:<devices> (e.g. cpu:64)")


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


LIBTPU_HINT = "install the TPU compiler with `pip install -e '.[tpu]'` (libtpu, ~590 MB; the dev extra includes it)"


@dataclass(frozen=True)
class PlanSpec:
    mode: str
    mesh: str
    batch: int
    seq_len: int
    remat: str | None = None  # None: PLAN_REMAT for the train modes, "none" for forward
    capacity_factor: float | None = None  # the expert-parallel buckets (-1: worst case, dropless; None: PLAN_CAPACITY)
    strategy: str | None = None  # rules column (None: plan_strategy of the mesh axes)


# A plan's defaults are the program one would deploy at full size, not the small-model defaults of ``k3 train``:
# dropless static buffers must hold every token routed to one device (at kimi-k3 / v5p-512 56x the balanced load:
# terabytes per chip), a 93-layer train step without remat keeps every layer's activations, and non-expert weights
# over fsdp alone leave ~100 GB/chip of fp32 state (experiments/LOG.md, 2026-12-02 session 10). Each default a plan
# used is reported under ``defaults`` in its JSON; the flags override them (``--capacity-factor -1`` is dropless).
PLAN_CAPACITY = 1.25
PLAN_REMAT = "full"


def plan_strategy(sizes: dict) -> str:
    """The rules column of a plan: ``zero3_ep_tp`` when the mesh has fsdp and expert axes (every non-expert weight
    over fsdp x expert, as full-size training state needs), otherwise the mesh's default (``default_strategy``)."""
    from k3jax.sharding import placement as place

    s = place.axis_sizes(sizes)
    return "zero3_ep_tp" if s["fsdp"] > 1 and s["expert"] > 1 else place.default_strategy(sizes)


def with_defaults(spec: PlanSpec) -> tuple[PlanSpec, dict]:
    """(``spec`` with every unset field filled, the filled fields and their values)."""
    from dataclasses import replace

    from k3jax.sharding import placement as place

    d = {}
    if spec.remat is None:
        d["remat"] = "none" if spec.mode == "forward" else PLAN_REMAT
    if spec.capacity_factor is None:
        d["capacity_factor"] = PLAN_CAPACITY
    if spec.strategy is None:
        d["strategy"] = plan_strategy(place.parse_mesh(spec.mesh))
    return replace(spec, **d), d


def _run_settings(cfg: K3Config, spec: PlanSpec):
    spec = with_defaults(spec)[0]
    if spec.mode == "forward":
        return default_run(cfg, layer_stack="scan", remat="none", compute_dtype="bfloat16", param_dtype="bfloat16")
    return default_run(cfg, layer_stack="scan", remat=spec.remat, compute_dtype="bfloat16", param_dtype="float32",
                       qat="weights+acts")


def check(cfg: K3Config, target: Target, spec: PlanSpec) -> tuple[dict, str]:
    """(mesh sizes, strategy) after every check a plan needs before it compiles; ValueError naming the value.
    Unset fields of ``spec`` are checked as ``with_defaults`` fills them."""
    from k3jax.sharding import placement as place
    from k3jax.sharding.rules import param_specs

    if spec.mode not in MODES:
        raise ValueError(f"--mode {spec.mode!r}: unknown; known: {', '.join(MODES)}")
    spec, _ = with_defaults(spec)
    if spec.remat not in REMAT_POLICIES:
        raise ValueError(f"--remat {spec.remat!r}: unknown policy; known: {', '.join(REMAT_POLICIES)}")
    if spec.mode == "forward" and spec.remat != "none":
        raise ValueError(f"--remat {spec.remat}: remat trades memory of the backward pass; --mode forward has none")
    if spec.batch < 1 or spec.seq_len < 1:
        raise ValueError(f"--batch {spec.batch} --seq-len {spec.seq_len}: both must be >= 1")
    if not (spec.capacity_factor == -1 or spec.capacity_factor > 0):
        raise ValueError(f"--capacity-factor {spec.capacity_factor}: must be > 0 or -1 (worst case, dropless)")
    if spec.mode == "frozen-experts" and cfg.expert_format != "mxfp4":
        raise ValueError(f"--mode frozen-experts: {cfg.name} stores its routed experts as {cfg.expert_format}, "
                         "not MXFP4 bytes")
    sizes = place.parse_mesh(spec.mesh)
    n = math.prod(sizes.values())
    if n != target.devices:
        raise ValueError(f"--mesh {spec.mesh}: {n} devices, but --target {target.spec} has {target.devices}")
    strategy = place.check_strategy(spec.strategy)
    abstract = _abstract_params(cfg, spec)
    try:
        param_specs(cfg, strategy, sizes, abstract)
    except ValueError as e:
        raise ValueError(f"--mesh {spec.mesh} (strategy {strategy}): {e}") from None
    ways = place.token_parallel(strategy, sizes)
    if spec.batch % ways:
        raise ValueError(f"--batch {spec.batch}: not divisible by the {ways} ways the batch is split (mesh axes "
                         f"{', '.join(place.token_axes(strategy, sizes))})")
    if target.platform == "tpu" and not libtpu_installed():
        raise ValueError(f"--target {target.spec}: libtpu is not installed; {LIBTPU_HINT}")
    return sizes, strategy


def _abstract_params(cfg: K3Config, spec: PlanSpec) -> dict:
    from k3jax.model import abstract_params
    from k3jax.sharding.placement import packed_form

    p = abstract_params(cfg, _run_settings(cfg, spec))
    return packed_form(p) if spec.mode in ("forward", "frozen-experts") else p


# --------------------------------------------------------------------------------------------- closed-form estimate

# (block, leaf) the official checkpoint stores as F32 (../shared/k3/tensors.tsv.gz: e_score_correction_bias, and
# A_log, dt_bias, the q/k/v conv1d weights and o_norm of every KDA layer); every other non-expert tensor is BF16
F32_STORED = {("moe", "bias"), *(("kda", k) for k in ("A_log", "dt_bias", "conv_q", "conv_k", "conv_v", "o_norm"))}


def _per_device(shape, pspec, sizes) -> float:
    ways = 1
    for ax in pspec:
        for a in (ax,) if isinstance(ax, str) else (ax or ()):
            ways *= sizes[a]
    return math.prod(shape) / ways


def _with_specs(tree, specs) -> list:
    """[((path, leaf), PartitionSpec)] of a params tree and its ``param_specs``."""
    return list(zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(
        specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)), strict=True))


def estimate_arguments(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str) -> dict:
    """Closed-form bytes per device of the program's arguments: for every parameter of the config (shape from the
    config), its elements per device under the rules' shardings × the bytes the mode stores per element —
    forward: the checkpoint's dtypes — 4 for the tensors it stores F32 (``F32_STORED``), 2 (BF16) for every other
    weight, 1 per packed MXFP4 byte / E8M0 scale; train and frozen-experts: 4 (fp32
    master) + optimizer state (Muon: 4, momentum; AdamW: 8, two moments; the frozen router bias: 0), packed experts
    as stored. Plus the tokens (int32, split over the batch axes). Step counters, the RNG key and Muon's
    Newton–Schulz coefficients are left out (bytes). ``gradient_bytes``: 4 per trainable element (the lower bound's
    gradient term; not an argument)."""
    from k3jax.sharding import placement as place
    from k3jax.sharding.rules import param_specs
    from k3jax.train.optim import leaf_rule

    abstract = _abstract_params(cfg, spec)
    specs = param_specs(cfg, strategy, sizes, abstract)
    state_per_label = {"muon": 4, "adam_decay": 8, "adam_nodecay": 8, "frozen": 0}
    out = {"weights": 0.0, "optimizer": 0.0, "packed_experts": 0.0, "tokens": 0.0, "gradient_bytes": 0.0}
    for (path, leaf), pspec in _with_specs(abstract, specs):
        n = _per_device(leaf.shape, pspec, sizes)
        name = key_names(path)[-1]
        if isinstance(name, str) and name.endswith(("_packed", "_scale")):
            out["packed_experts"] += n
        elif spec.mode == "forward":
            names = key_names(path)
            out["weights"] += (4 if tuple(names[-2:]) in F32_STORED else 2) * n
        else:
            label = leaf_rule(path, leaf)[0]
            out["weights"] += 4 * n
            out["optimizer"] += state_per_label[label] * n
            out["gradient_bytes"] += 0 if label == "frozen" else 4 * n
    ways = place.token_parallel(strategy, sizes)
    out["tokens"] = 4 * spec.batch * (spec.seq_len + (spec.mode != "forward")) / ways
    out["total"] = out["weights"] + out["optimizer"] + out["packed_experts"] + out["tokens"]
    return out


def active_params(cfg: K3Config) -> tuple[float, float]:
    """(parameters one token multiplies by, the routed experts' share of them): every weight but the input
    embedding (unless tied) and the router bias, routed experts at top-k / E (``k3 plan``'s ``active_params``)."""
    from k3jax.model import abstract_params

    total = experts = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]:
        names = key_names(path)
        if (names[0] == "embed" and not cfg.tie_word_embeddings) or names[-2:] == ("moe", "bias"):
            continue
        n = math.prod(leaf.shape)
        if "experts" in names:
            n = n * cfg.num_experts_per_token / cfg.num_experts
            experts += n
        total += n
    return total, experts


def newton_schulz_flops(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str, ns_steps: int) -> dict:
    """Matmul FLOPs of Muon's Newton–Schulz in one optimizer step, from the config and the optimizer's rules: per
    orthogonalized [m, n] block (per head / per expert / per layer, ``train.optim.leaf_rule``), a = min(m, n),
    b = max(m, n), each step is A = X·Xᵀ (2a²b), A·A (2a³), (c₁A + c₂A²)·X (2a²b) — optax's quintic iteration.
    ``global``: each block once; ``per_device``: each leaf's share on one device if the work splits as its
    sharding splits the leaf (a replicated leaf is orthogonalized whole on every device). That split is the ideal:
    XLA computes X·Xᵀ of a sharded block in pieces but may hold A whole and square it on every device (on v6e-256,
    each shared-expert block's 6144² A·A: 9/10 of the frozen step's optimizer FLOPs, experiments/LOG.md). At full
    size with the experts trained this is comparable to 6·N·tokens (every expert's 3072 x 3584 blocks, whatever
    the batch)."""
    from k3jax.sharding.placement import split_packed
    from k3jax.sharding.rules import param_specs
    from k3jax.train.optim import leaf_rule

    out = {"global": 0.0, "per_device": 0.0}
    if spec.mode == "forward":  # no optimizer step
        return out
    abstract = split_packed(_abstract_params(cfg, spec))[0]  # packed (frozen) experts are not optimized
    specs = param_specs(cfg, strategy, sizes, abstract)
    for (path, leaf), pspec in _with_specs(abstract, specs):
        label, dims, reshape = leaf_rule(path, leaf)
        if label != "muon":
            continue
        stacked = key_names(path)[0] == "groups"
        layers = leaf.shape[0] if stacked else 1
        shape = tuple(reshape or (leaf.shape[1:] if stacked else leaf.shape))
        axis = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
        red, outs = axis(dims.reduction_axis), axis(dims.output_axis)
        m, n = math.prod(shape[i] for i in red), math.prod(shape[i] for i in outs)
        blocks = layers * math.prod(shape) // (m * n)
        a, b = min(m, n), max(m, n)
        f = blocks * ns_steps * (4.0 * a * a * b + 2.0 * a ** 3)
        out["global"] += f
        out["per_device"] += f * _per_device(leaf.shape, pspec, sizes) / math.prod(leaf.shape)
    return out


def model_flops(cfg: K3Config, spec: PlanSpec, sizes: dict | None = None, strategy: str | None = None) -> dict:
    """FLOPs of one step from the config: ``6 · N_active · tokens`` (train; the issue's check), with the terms a
    mode changes — forward 2·N, frozen experts 6·N_other + 4·N_experts (no expert weight gradients), and the
    recompute of one forward (+2·N) under a remat policy that saves nothing of the layer; with the mesh
    (``sizes``, ``strategy``), plus the optimizer's Newton–Schulz split over the devices (``newton_schulz_flops``:
    per device x devices, so a replicated block counts once per device, as the compiled program's total does)."""
    from k3jax.train.optim import OptimConfig

    spec = with_defaults(spec)[0]
    n_active, n_exp = active_params(cfg)
    tokens = spec.batch * spec.seq_len
    six = 6.0 * n_active * tokens
    if spec.mode == "forward":
        expected = 2.0 * n_active * tokens
    elif spec.mode == "frozen-experts":
        expected = (6.0 * (n_active - n_exp) + 4.0 * n_exp) * tokens
    else:
        expected = six
    if spec.mode != "forward" and spec.remat in ("full", "nothing_saveable"):
        expected += 2.0 * n_active * tokens
    out = {"active_params": n_active, "tokens": tokens, "six_n_tokens": six, "model": expected}
    if sizes is not None:
        ns = newton_schulz_flops(cfg, spec, sizes, strategy, OptimConfig().ns_steps)
        out["newton_schulz"] = ns["global"]
        out["newton_schulz_split"] = ns["per_device"] * math.prod(sizes.values())
        expected += out["newton_schulz_split"]
    out["expected"] = expected
    return out


# ------------------------------------------------------------------------------------------------------ programs

def target_devices(target: Target) -> list:
    if target.platform == "tpu":
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(topology_name=target.topology, platform="tpu").devices)
    devs = jax.devices("cpu")
    if len(devs) != target.devices:
        raise RuntimeError(f"--target {target.spec}: this process has {len(devs)} CPU devices; start it with "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={target.devices}")
    return devs


def _mesh(sizes: dict, devices: list):
    from k3jax.sharding.mesh import MESH_AXES, make_mesh

    shape = tuple(sizes[a] for a in MESH_AXES)
    if devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        try:  # physical locality: the innermost mesh axes on the nearest chips
            arr = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
            return make_mesh(sizes, devices=arr.reshape(-1))
        except (ValueError, NotImplementedError, AssertionError):
            pass
    return make_mesh(sizes, devices=devices)


def _sds(shapes, shardings):
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def build_program(cfg: K3Config, spec: PlanSpec, mesh, strategy: str):
    """(jitted function, abstract arguments with shardings) of the mode's program on ``mesh``."""
    from k3jax.model import forward
    from k3jax.sharding import placement as place
    from k3jax.sharding.expert_parallel import ExpertParallel
    from k3jax.sharding.rules import mesh_axes_of, param_shardings
    from k3jax.train.optim import OptimConfig, make_optimizer
    from k3jax.train.step import StepSpec, init_state, make_train_step

    spec = with_defaults(spec)[0]
    run = _run_settings(cfg, spec)
    dispatch = (ExpertParallel(mesh, strategy, capacity_factor=spec.capacity_factor)
                if mesh_axes_of("experts", strategy, mesh) else None)
    abstract = _abstract_params(cfg, spec)
    if spec.mode == "forward":
        p_sh = param_shardings(cfg, strategy, mesh, abstract)
        tok_sh = place.batch_sharding(strategy, mesh, 2)
        fn = jax.jit(lambda p, t: forward(p, t, cfg, run, dispatch=dispatch), in_shardings=(p_sh, tok_sh),
                     out_shardings=place.batch_sharding(strategy, mesh, 3))
        return fn, (_sds(abstract, p_sh), jax.ShapeDtypeStruct((spec.batch, spec.seq_len), jnp.int32,
                                                              sharding=tok_sh))
    params, frozen = place.split_packed(abstract)
    # make_optimizer reads per-layer shapes by slicing stacked leaves: zero-stride views, no memory
    tx, _ = make_optimizer(jax.tree.map(lambda s: np.broadcast_to(np.zeros((), s.dtype), s.shape), params),
                           OptimConfig(total_steps=1000))
    shapes = jax.eval_shape(lambda p, f: init_state(p, tx, frozen=f or None), params, frozen)
    st_sh = place.state_shardings(cfg, strategy, mesh, shapes)
    tok_sh = place.batch_sharding(strategy, mesh, 3, batch_dim=1)
    step = make_train_step(cfg, run, tx, StepSpec(), dispatch=dispatch)
    fn = jax.jit(step, in_shardings=(st_sh, tok_sh, None), out_shardings=(st_sh, None), donate_argnums=0)
    return fn, (_sds(shapes, st_sh), jax.ShapeDtypeStruct((1, spec.batch, spec.seq_len + 1), jnp.int32,
                                                          sharding=tok_sh),
                jax.ShapeDtypeStruct((), jnp.float32))


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


def roofline(chip: Chip | None, flops: float, hbm_bytes: float, coll_bytes: float) -> dict | None:
    """Step time bounds at the chip's published peaks (per device): compute, HBM and collective terms; the step
    cannot be faster than the largest."""
    if chip is None:
        return None
    terms = {"compute_s": flops / chip.peak_flops, "memory_s": hbm_bytes / chip.hbm_bandwidth,
             "collective_s": coll_bytes / chip.ici_bandwidth}
    bound = max(terms, key=terms.get)
    return {"chip": chip.name, "peak_flops": chip.peak_flops, "hbm_bandwidth": chip.hbm_bandwidth,
            "ici_bandwidth": chip.ici_bandwidth, **terms, "step_s": terms[bound], "bound": bound[:-2]}


def compile_plan(cfg: K3Config, target: Target, spec: PlanSpec, log=None, hlo_out: str | None = None) -> dict:
    """Compile ``spec``'s program for ``target`` and report (see the module docstring). Raises HbmOomError (with
    ``.plan`` holding everything known before the compile) when the program does not fit. ``hlo_out``: a path
    to write the compiled HLO text to."""
    from k3jax.analysis.hlo import largest_values, program_stats
    from k3jax.sharding.placement import format_mesh

    log = log or (lambda s: None)
    t_start = time.perf_counter()
    sizes, strategy = check(cfg, target, spec)
    spec, defaults = with_defaults(spec)
    est = estimate_arguments(cfg, spec, sizes, strategy)
    mesh = _mesh(sizes, target_devices(target))
    run = _run_settings(cfg, spec)
    out = {"preset": cfg.name, "target": target.spec, "platform": target.platform, "devices": target.devices,
           "mesh": format_mesh(sizes), "strategy": strategy, "mode": spec.mode, "remat": spec.remat,
           "batch": spec.batch, "seq_len": spec.seq_len, "layer_stack": run.layer_stack, "qat": run.qat,
           "param_dtype": run.param_dtype, "compute_dtype": run.compute_dtype,
           "capacity_factor": spec.capacity_factor, "defaults": defaults,
           "estimated_argument_bytes_per_device": est["total"], "estimate": est}
    cap = target.chip.hbm_bytes if target.chip else None
    out["capacity_bytes_per_device"] = cap
    if spec.mode != "forward":
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
        # the TPU compiler enforces its own HBM budget (a program over it fails to compile, HbmOomError); XLA:CPU none
        out["fits"] = True if target.platform == "tpu" else None
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    out["cost_analysis"] = {k: float(cost[k]) for k in ("flops", "bytes accessed", "transcendentals")
                            if cost and k in cost}
    text = compiled.as_text()
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(text)
    stats = program_stats(text)
    out["hlo"] = {**stats.as_dict(), "largest_values": largest_values(text)}
    coll_bytes = sum(v["bytes"] for v in stats.collectives.values())
    out["collectives"] = stats.collectives
    out["collective_bytes_per_device"] = coll_bytes
    mf = model_flops(cfg, spec, sizes, strategy)
    compiled_global = stats.flops * target.devices
    out["flops"] = {**mf, "compiled_per_device": stats.flops, "compiled_global": compiled_global,
                    "compiled_over_expected": compiled_global / mf["expected"],
                    "compiled_over_six_n_tokens": compiled_global / mf["six_n_tokens"]}
    if spec.mode == "train":
        # the check of the train step: the loop-corrected compiled FLOPs within 20% of 6·N_active·tokens
        # (+ one recomputed forward under a remat that saves nothing, + Muon's Newton–Schulz split over the
        # devices); loops with routing-dependent trip counts are counted once (hlo.unknown_trip_counts), so the
        # check is only meaningful where there are none
        out["flops"]["within_20pct_of_expected"] = bool(abs(compiled_global / mf["expected"] - 1) <= 0.2)
    out["roofline"] = roofline(target.chip, stats.flops, stats.bytes_accessed, coll_bytes)
    out["wall_s"] = time.perf_counter() - t_start
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux ru_maxrss is in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


__all__ = ["CHIPS", "MODES", "Chip", "HbmOomError", "PlanSpec", "Target", "build_program", "check",
           "compile_plan", "compile_program", "estimate_arguments", "libtpu_installed", "model_flops",
           "newton_schulz_flops", "oom_figures", "parse_target", "peak_rss_bytes", "plan_strategy", "roofline",
           "target_devices", "with_defaults"]
