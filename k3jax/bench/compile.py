"""`k3 bench compile --json`: lower and compile time (separately) of the forward and of the full train step
(``--parts``; ``grad``, the train step's value_and_grad alone, on request) at depth 12, 48 and 92 with K3's layer
schedule, the layer stack unrolled ("loop") or scanned ("scan"); and the activation memory (XLA temp bytes) of the
train step's value_and_grad per remat policy, for each stack.

    k3 bench compile --json                                   # k3-micro width, depths 12,48,92, B=1, T=64
    k3 bench compile --json --stacks scan --depths 12,92      # the target alone (the unrolled 92 is the slow part)
    k3 bench compile --json --parts forward,grad,train_step   # + the value_and_grad alone
    k3 bench compile --json --preset k3-tiny --depths 4,8 --remat-policies none,full    # the test's size

Nothing is executed: parameters, optimizer state and tokens are ShapeDtypeStructs and every program goes through
``jit(...).lower(...)`` (``lower_s``: tracing + StableHLO) then ``.compile()`` (``compile_s``: XLA). The train step
is ``k3jax.train.step.make_train_step`` with the K3 optimizer (``k3jax.optim.optimizer.make_optimizer``, per-head Muon),
Quantile Balancing and QK-Clip, one micro-batch; ``grad`` is its ``make_loss`` under value_and_grad (the model's
share of the step, what the scan acts on; the optimizer updates stacked leaves per layer whatever the stack).
Depth L keeps K3's schedule (``k3_full_attn_layers``: MLA where l mod 4 = 3 and at the last layer; AttnRes blocks of
12; layer 0 dense), at the preset's width.

``ratios``: ``compile_time_{hi}_over_{lo}_scan`` / ``_loop`` (train-step compile time at the deepest over the
shallowest depth), the same with ``forward_`` and ``grad_`` prefixes, ``scan_over_loop_{hi}`` (each part; both
stacks timed), and ``remat_temp_{policy}_over_none_{stack}`` (activation temp bytes against no remat).
``ok``: the train step's scanned compile time grows at most 2x from the shallowest to the deepest depth.
Times are wall clock of one process; on a shared machine they are inflated (the ratios less so). The unrolled
stack is the slow part by design: its 92-layer train step alone compiles for ~11 minutes on this 2-core machine
(value_and_grad: 8 more, hence not a default part), the scanned one in under a minute (experiments/LOG.md).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import REMAT_POLICIES, K3Config, RunConfig, default_run, get_preset, k3_full_attn_layers
from k3jax.errors import InputError, int_list
from k3jax.model import forward, init_params
from k3jax.optim.optimizer import OptimConfig, make_optimizer
from k3jax.train.step import StepSpec, init_state, make_loss, make_train_step

STACKS = ("loop", "scan")
PARTS = ("forward", "grad", "train_step")
TARGET_SCAN_GROWTH = 2.0  # train-step compile time at 92 layers / at 12, scanned (goal 1.3)


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="k3-micro", help="the width (and vocabulary) of every depth")
    parser.add_argument("--depths", default="12,48,92", help="comma-separated layer counts (K3's schedule each)")
    parser.add_argument("--stacks", default="loop,scan", help="layer stacks to time (loop, scan or both)")
    parser.add_argument("--parts", default="forward,train_step", help="programs to time, of forward, grad (the "
                        "train step's value_and_grad alone: the unrolled 92-layer one compiles for 8+ minutes) and "
                        "train_step")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--remat-policies", default=",".join(REMAT_POLICIES),
                        help=f"policies of the temp-bytes section (of {', '.join(REMAT_POLICIES)}; '' skips it)")
    parser.add_argument("--remat-depth", type=int, default=None, help="depth of the remat section (default: the "
                        "shallowest of --depths)")
    parser.add_argument("--remat-batch", type=int, default=4)
    parser.add_argument("--remat-seq-len", type=int, default=256, help="long enough that activations dominate")


def k3_schedule(cfg: K3Config, L: int) -> K3Config:
    """``cfg`` at depth L with K3's layer schedule: MLA at every 4th layer and the last, AttnRes blocks of 12."""
    return cfg.replace(num_layers=L, full_attn_layers=k3_full_attn_layers(L),
                       attn_res_block_size=12 if cfg.uses_attn_res else None)


def _abstract_params(cfg: K3Config, run: RunConfig):
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), run))


def _timed(fn, *args) -> tuple[dict, object]:
    """({"lower_s", "compile_s"}, compiled) of ``jax.jit(fn)`` on abstract ``args``."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1}, compiled


def compile_times(cfg: K3Config, run: RunConfig, *, batch: int, seq_len: int, log=None, parts=PARTS) -> dict:
    """Lower and compile seconds of the forward, of the train step's value_and_grad alone (``grad``: the model's
    share of the step, what the scan acts on) and of the real train step (nothing runs), those of them in ``parts``:
    ``{"forward": {"lower_s", "compile_s"}, "grad": {...}, "train_step": {...}}``; ``log(part, times)`` after each."""
    log = log or (lambda part, t: None)

    params = _abstract_params(cfg, run)
    out = {}
    if "forward" in parts:
        out["forward"], _ = _timed(lambda p, t: forward(p, t, cfg, run), params,
                                   jax.ShapeDtypeStruct((batch, seq_len), jnp.int32))
        log("forward", out["forward"])
    if "grad" in parts:
        out["grad"], _ = _timed(_loss_grad(cfg, run), params, jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32))
        log("grad", out["grad"])
    if "train_step" not in parts:
        return out
    # make_optimizer slices stacked leaves to read per-layer shapes: hand it zero-stride views, not arrays
    tx, _ = make_optimizer(jax.tree.map(lambda s: np.broadcast_to(np.zeros((), s.dtype), s.shape), params),
                           OptimConfig(total_steps=1000))
    state = jax.eval_shape(lambda p: init_state(p, tx), params)
    step = make_train_step(cfg, run, tx, StepSpec())
    out["train_step"], _ = _timed(step, state, jax.ShapeDtypeStruct((1, batch, seq_len + 1), jnp.int32),
                                  jax.ShapeDtypeStruct((), jnp.float32))
    log("train_step", out["train_step"])
    return out


def _loss_grad(cfg: K3Config, run: RunConfig):
    return jax.value_and_grad(make_loss(cfg, run, StepSpec()), has_aux=True)


def compile_train_grad(cfg: K3Config, run: RunConfig, *, batch: int, seq_len: int):
    """The compiled value_and_grad of the train step's loss (``k3jax.train.step.make_loss``) for parameters of
    ``cfg`` and [batch, seq_len + 1] int32 tokens (abstract inputs: compiled, not run). Call it as
    ``compiled(params, tokens) → ((loss, (ce, aux)), grads)``."""
    _, compiled = _timed(_loss_grad(cfg, run), _abstract_params(cfg, run),
                         jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32))
    return compiled


def temp_bytes(compiled) -> int:
    """XLA temp bytes of a compiled program (``memory_analysis().temp_size_in_bytes``: activations and scratch)."""
    mem = compiled.memory_analysis()
    if mem is None:
        raise RuntimeError(f"the {jax.default_backend()} backend reports no memory analysis")
    return int(mem.temp_size_in_bytes)


def train_temp_bytes(cfg: K3Config, run: RunConfig, *, batch: int, seq_len: int) -> int:
    """Temp bytes of ``compile_train_grad``: the activation memory of one train-step gradient under ``run.remat``."""
    return temp_bytes(compile_train_grad(cfg, run, batch=batch, seq_len=seq_len))


def remat_temp_bytes(cfg: K3Config, run: RunConfig, *, batch: int, seq_len: int,
                     policies=REMAT_POLICIES, stacks=STACKS) -> dict:
    """``{stack: {policy: train_temp_bytes}}`` for each remat policy and layer stack (an unknown policy is a
    ConfigError from ``RunConfig``)."""
    return {st: {p: train_temp_bytes(cfg, run.replace(layer_stack=st, remat=p), batch=batch, seq_len=seq_len)
                 for p in policies} for st in stacks}


def _progress(part: str, t: dict) -> None:
    print(f"  {part}: lower {t['lower_s']:.1f} s, compile {t['compile_s']:.1f} s", file=sys.stderr, flush=True)


def run(args) -> dict:
    depths = sorted(set(int_list(args.depths, "--depths", minimum=1)))
    stacks = [st for st in STACKS if st in args.stacks.split(",")]
    if not stacks or set(args.stacks.split(",")) - set(STACKS):
        raise InputError(f"--stacks {args.stacks!r}: must be loop, scan or loop,scan")
    parts = [p for p in PARTS if p in args.parts.split(",")]
    if not parts or set(args.parts.split(",")) - set(PARTS):
        raise InputError(f"--parts {args.parts!r}: must be a comma-separated subset of {', '.join(PARTS)}")
    policies = [p for p in args.remat_policies.split(",") if p]
    bad = [p for p in policies if p not in REMAT_POLICIES]
    if bad:
        raise InputError(f"--remat-policies {bad[0]!r}: must be one of {', '.join(REMAT_POLICIES)}")
    for name in ("batch", "seq_len", "remat_batch", "remat_seq_len"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    base = get_preset(args.preset)
    remat_depth = args.remat_depth or depths[0]
    t_all = time.perf_counter()
    times: dict = {}
    for L in depths:
        cfg = k3_schedule(base, L)
        for st in stacks:
            print(f"compiling {args.preset} at {L} layers, {st} ...", file=sys.stderr, flush=True)
            times.setdefault(str(L), {})[st] = compile_times(cfg, default_run(cfg, layer_stack=st),
                                                             batch=args.batch, seq_len=args.seq_len, log=_progress,
                                                             parts=parts)
    remat = {}
    if policies:
        print(f"remat temp bytes at {remat_depth} layers, B={args.remat_batch}, T={args.remat_seq_len} ...",
              file=sys.stderr, flush=True)
        cfg = k3_schedule(base, remat_depth)
        remat = remat_temp_bytes(cfg, default_run(cfg), batch=args.remat_batch, seq_len=args.remat_seq_len,
                                 policies=policies, stacks=stacks)
    lo, hi = str(depths[0]), str(depths[-1])
    ratios = {}
    for part, prefix in (("train_step", ""), ("forward", "forward_"), ("grad", "grad_")):
        if part not in parts:
            continue
        c = {(L, st): times[L][st][part]["compile_s"] for L in (lo, hi) for st in stacks}
        if lo != hi:
            for st in stacks:
                ratios[f"{prefix}compile_time_{hi}_over_{lo}_{st}"] = c[hi, st] / c[lo, st]
        if len(stacks) == 2:
            ratios[f"{prefix}scan_over_loop_{hi}"] = c[hi, "scan"] / c[hi, "loop"]
    for st, per in remat.items():
        for p, b in per.items():
            if p != "none" and "none" in per:
                ratios[f"remat_temp_{p}_over_none_{st}"] = b / per["none"]
    growth = ratios.get(f"compile_time_{hi}_over_{lo}_scan")
    return {
        "name": "compile",
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "shape": {"preset": args.preset, "depths": depths, "stacks": stacks, "parts": parts, "batch": args.batch,
                  "seq_len": args.seq_len, "hidden_size": base.hidden_size,
                  "attn_res_block_size": 12 if base.uses_attn_res else None},
        "times": times,
        "remat": {"depth": remat_depth, "batch": args.remat_batch, "seq_len": args.remat_seq_len,
                  "temp_bytes": remat},
        "wall_s": time.perf_counter() - t_all,
        "ratios": ratios,
        "target": {"compile_time_scan_growth_max": TARGET_SCAN_GROWTH},
        "ok": None if growth is None else bool(growth <= TARGET_SCAN_GROWTH),
    }
