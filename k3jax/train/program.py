"""The programs of a training run, built once per process for each (model, run settings, optimizer, step settings,
mesh): the parameters' and the train state's placement, the jitted random init, train step and held-out scorer
(``programs``), the initial parameters (``initial_params``: a checkpoint, a function or the random init), and how a
parameter tree splits into what trains and what stays frozen (``trained_and_frozen``, ``full_params``).
``k3jax.train.loop`` runs them.

The train step itself — the optimizer, the train state's and the batch's placement, the step jitted with the state
donated — is built by ``train_step_program`` alone: `k3 train` (``programs``) and `k3 plan --compile`'s train modes
(``k3jax.plan.aot``) both call it, so the program a plan measures is the one a run runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from k3jax.checkpoint.load import load
from k3jax.config import K3Config, RunConfig
from k3jax.layers.experts import merge_trees, packed_form, split_packed
from k3jax.layers.lora import split_adapters
from k3jax.model import abstract_params, init_params
from k3jax.optim.optimizer import OptimConfig, make_optimizer
from k3jax.sharding import param_shardings
from k3jax.sharding import placement as place
from k3jax.sharding.rules import param_specs
from k3jax.train.evaluate import make_scorer
from k3jax.train.settings import TrainConfig, keeps_packed
from k3jax.train.step import init_state, make_train_step


@dataclass(frozen=True)
class TrainStep:
    """The train step of one (model, run settings, optimizer, step settings, mesh, dispatch) and its placement."""

    tx: Any  # the optimizer
    init_state: Callable  # (trained params, frozen params, seed) -> the train state (not jitted)
    state_shapes: dict  # ShapeDtypeStructs of the train state
    state_sh: dict  # NamedSharding per train-state leaf
    batch_sh: NamedSharding  # [M, b, T + 1]: b is split
    step: Callable  # jitted (state, tokens, poison) -> (state, metrics), the state donated


def train_batch_sharding(strategy: str, mesh: Mesh, dispatch) -> NamedSharding:
    """The placement of a train step's batches [M, b, T + 1]: b over the token axes — with a context split, over
    its batch axes (the model splits the T it runs on)."""
    context = getattr(dispatch, "context", None)  # the sequence split (k3jax/sharding/context_parallel)
    if context is None:
        return place.batch_sharding(strategy, mesh, 3, batch_dim=1)
    return context.sharding(3, batch_dim=1, seq=False)


def train_step_program(cfg: K3Config, settings: RunConfig, ocfg: OptimConfig, spec, strategy: str, mesh: Mesh,
                       abstract: dict, dispatch) -> TrainStep:
    """The train step of ``abstract`` (the parameter tree as ShapeDtypeStructs, packed experts included): its
    trained and frozen leaves split (``trained_and_frozen``), the optimizer over the trained ones (``ocfg``), the
    train state placed by the rules (``strategy`` on ``mesh``), the batch placement and the step (``spec``: its
    balancing and QK-Clip; ``dispatch``: the MoE's) jitted with the state donated."""
    trained, frozen = trained_and_frozen(abstract, settings)
    # make_optimizer reads the leaves' shapes only: zero-stride views of them, no memory
    views = jax.tree.map(lambda s: np.broadcast_to(np.zeros((), s.dtype), s.shape), trained)
    tx, _ = make_optimizer(views, ocfg, mesh=mesh, specs=param_specs(cfg, strategy, mesh, trained))
    init = lambda p, f, seed: init_state(p, tx, seed, frozen=f or None)  # noqa: E731
    shapes = jax.eval_shape(init, trained, frozen, 0)
    state_sh = place.state_shardings(cfg, strategy, mesh, shapes)
    batch_sh = train_batch_sharding(strategy, mesh, dispatch)
    step = jax.jit(make_train_step(cfg, settings, tx, spec, dispatch=dispatch),
                   in_shardings=(state_sh, batch_sh, None), out_shardings=(state_sh, None), donate_argnums=0)
    return TrainStep(tx=tx, init_state=init, state_shapes=shapes, state_sh=state_sh, batch_sh=batch_sh, step=step)


@dataclass(frozen=True)
class Programs:
    """The placement and jitted programs of one (model, run settings, optimizer, step settings, mesh)."""

    param_sh: Any  # NamedSharding per parameter leaf (packed experts included)
    init_params: Callable  # key -> the random initial parameters, placed
    init_adapters: Callable  # key -> fresh LoRA adapters alone (B = 0), placed: beside a loaded base
    tx: Any  # the optimizer
    init_state: Callable  # (params, frozen, seed) -> the train state, placed
    state_sh: dict
    batch_sh: NamedSharding  # [M, b, T + 1]: b is split
    dispatch: Any  # the MoE's expert-parallel dispatch, or None
    step: Callable  # (state, tokens, poison) -> (state, metrics)
    score: Callable  # the held-out scorer (k3jax.train.evaluate.make_scorer)


@functools.lru_cache(maxsize=8)
def programs(cfg: K3Config, settings: RunConfig, ocfg: OptimConfig, spec, strategy: str, mesh: Mesh,
              frozen_experts: bool, micro_batch: int) -> Programs:
    """A run's programs, built once per process for each key: runs that differ only in their seed, data, length,
    initial parameters or outputs — `k3 ablate`'s seeds, a resumed run, a notebook's or a test's repeated runs —
    reuse the jitted init, train step and scorer, and JAX reuses their compiled executables (a k3-tiny train step is
    ~35 s of XLA:CPU compile, its random init ~20 s: experiments/LOG.md 2026-12-03, session 13)."""
    abstract = abstract_params(cfg, settings)
    if frozen_experts:
        abstract = packed_form(abstract)
    param_sh = param_shardings(cfg, strategy, mesh, abstract)
    # with a context axis: the sequence split; packed experts by the run's kernel choice
    dispatch = place.expert_dispatch(strategy, mesh, batch=micro_batch, packed_kernel=settings.packed_kernel)
    ts = train_step_program(cfg, settings, ocfg, spec, strategy, mesh, abstract, dispatch)
    return Programs(
        param_sh=param_sh,
        init_params=jax.jit(lambda k: init_params(cfg, k, settings), out_shardings=param_sh),
        init_adapters=jax.jit(lambda k: trained_and_frozen(init_params(cfg, k, settings), settings)[0],
                              out_shardings=trained_and_frozen(param_sh, settings)[0]),
        tx=ts.tx, init_state=jax.jit(ts.init_state, out_shardings=ts.state_sh), state_sh=ts.state_sh,
        batch_sh=ts.batch_sh, dispatch=dispatch, step=ts.step,
        score=make_scorer(cfg, settings, params_sharding=full_params(ts.state_sh),
                          batch_sharding=place.batch_sharding(strategy, mesh, 2), dispatch=dispatch))


def initial_params(cfg: K3Config, settings: RunConfig, tc: TrainConfig, prog: Programs, log=None):
    """The initial parameters placed with the programs' parameter shardings."""
    if tc.init_fn is not None:
        return jax.device_put(tc.init_fn(cfg, settings), prog.param_sh)
    if tc.init:
        st: dict = {}
        base_sh = trained_and_frozen(prog.param_sh, settings)[1] if settings.lora else prog.param_sh
        _, params = load(tc.init, cfg=cfg, shardings=base_sh, dtype=jnp.float32, progress=tc.progress,
                         strict_config=tc.strict_config, stats=st, keep_experts_packed=keeps_packed(tc, cfg))
        if settings.lora:
            params = merge_trees(params, prog.init_adapters(jax.random.key(tc.seed)))
        if log is not None:
            log(f"loaded {tc.init}: {st['bytes_read'] / 2**20:,.1f} MiB read in {st['seconds']:.1f} s "
                f"({st['bytes_read'] / 2**20 / max(st['seconds'], 1e-9):,.0f} MiB/s), "
                f"{place.bytes_per_device(params) / 2**20:,.1f} MiB of parameters per device")
        return params
    return prog.init_params(jax.random.key(tc.seed))


def trained_and_frozen(tree, settings: RunConfig) -> tuple[dict, dict]:
    """(trained leaves, frozen leaves) of a params tree (or of its shardings): with LoRA the adapters alone train
    and the whole base is frozen; otherwise only packed routed experts are frozen (``--frozen-experts``)."""
    if settings.lora is not None:
        return split_adapters(tree)
    return split_packed(tree)


def full_params(state: dict):
    """The whole parameter tree of a train state (or of its shardings): the trained leaves and any frozen ones."""
    return merge_trees(state["params"], state.get("frozen"))


__all__ = ["Programs", "TrainStep", "full_params", "initial_params", "programs", "train_batch_sharding",
           "train_step_program", "trained_and_frozen"]
