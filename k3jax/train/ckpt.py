"""Orbax checkpoints of the train state, for exact resume (the official / HF layout is ``k3jax.checkpoint``).

    mngr = manager("runs/mini", keep=3, async_save=True)
    save_state(mngr, state, meta)                  # state: {"params", "opt", "step", "rng", "bad_streak"}
    state, meta = restore_state(mngr, like=fresh_state)
    step, params = load_checkpoint_params("runs/mini")   # numpy, on any device count

Orbax commits atomically (tmp dir + rename), so a run killed during an async save resumes from the previous step
that was saved.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.errors import InputError


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


__all__ = ["load_checkpoint_params", "manager", "read_meta", "restore_state", "save_state"]
