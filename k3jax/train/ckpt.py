"""Orbax checkpoints of the train state, for exact resume (the official / HF layout is ``k3jax.checkpoint``).

    mngr = manager("runs/mini", keep=3, async_save=True)
    save_state(mngr, state, meta)                  # state: {"params", "opt", "step", "rng", "bad_streak"}
    state, meta = restore_state(mngr, like=fresh_state)
    step, params = load_checkpoint_params("runs/mini")   # numpy, on any device count
    settings = trained_settings(meta, settings)          # the QAT rounding rules the checkpoint trained with

``meta`` is the run's record beside each step: ``{"train": TrainConfig.resume_key(), "run": run_record(settings),
"model": cfg.to_dict()}``. ``run`` keeps the run settings that are not train settings but belong to the trained
model: the QAT rounding rules, whose weight rule is the grid its MXFP4 export must use (docs/numerics.md §10.7);
a checkpoint written before they were recorded reads as the defaults it trained with.

Orbax commits atomically (tmp dir + rename), so a run killed during an async save resumes from the previous step
that was saved.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import RunConfig
from k3jax.errors import InputError

# orbax is imported inside the functions that use it: it takes ~2 s to import, which a run without --ckpt-dir (and
# every module importing the loop) would otherwise pay.

# The run settings a checkpoint records (``run_record``), and what one written before they were recorded ran with.
_RECORDED = {"qat_weight_rule": "even", "qat_act_rule": "ceil"}


def manager(directory: str, *, keep: int, async_save: bool):
    """An orbax CheckpointManager over ``directory`` keeping the latest ``keep`` steps."""
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=opts)


def _flat(state: dict) -> dict:
    """Orbax-friendly view: the optimizer state (NamedTuples with empty MaskedNodes) is saved as its leaf list."""
    return dict(state, opt=jax.tree.leaves(state["opt"]))


def save_state(mngr, state: dict, meta: dict, *, force: bool = False) -> None:
    import orbax.checkpoint as ocp

    step = int(state["step"])
    # The train step donates its state; give the (async) writer its own buffers so the next step cannot overwrite
    # arrays that are still being serialized (on CPU a host view of a device buffer may be zero-copy).
    state = jax.tree.map(jnp.copy, state)
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_flat(state)),
                                            meta=ocp.args.JsonSave(meta)), force=force)


def restore_state(mngr, like: dict, step: int | None = None) -> tuple[dict, dict]:
    """(state, meta) restored into the shapes, dtypes and shardings of ``like`` (a freshly initialised state)."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step() if step is None else step
    flat = _flat(like)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), flat)
    r = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                   meta=ocp.args.JsonRestore()))
    st = dict(r["state"])
    st["opt"] = jax.tree.unflatten(jax.tree.structure(like["opt"]), st["opt"])
    return st, r["meta"]


def read_meta(mngr, step: int | None = None) -> dict:
    """The run metadata saved beside a checkpoint (no array is read): checked before a state is restored."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step() if step is None else step
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def run_record(settings: RunConfig) -> dict:
    """The run settings a checkpoint keeps beside its train settings (``meta["run"]``): the QAT rounding rules."""
    return {k: getattr(settings, k) for k in _RECORDED}


def trained_settings(meta: dict, settings: RunConfig) -> RunConfig:
    """``settings`` with the QAT rounding rules of the checkpoint whose ``meta`` is given (``run_record``; absent in
    a checkpoint that predates the record: the defaults every run used then, weights "even", activations "ceil")."""
    saved = meta.get("run") or {}
    return settings.replace(**{k: saved.get(k, before) for k, before in _RECORDED.items()})


def load_checkpoint_params(ckpt_dir: str, step: int | None = None) -> tuple[int, dict]:
    """(step, params as numpy) of a training checkpoint, on any device count (for comparisons, export, tests)."""
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(os.path.abspath(ckpt_dir))
    step = mngr.latest_step() if step is None else step
    mngr.close()
    if step is None:
        raise InputError(f"{ckpt_dir}: no committed checkpoint")
    path = os.path.join(os.path.abspath(ckpt_dir), str(step), "state")
    ck = ocp.PyTreeCheckpointer()
    meta = ck.metadata(path)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    r = ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return step, r["params"]


__all__ = ["load_checkpoint_params", "manager", "read_meta", "restore_state", "run_record", "save_state",
           "trained_settings"]
