"""Where a model and the tokens it reads come from: a checkpoint directory (loaded), a preset (random init) or the
trained k3-mini shipped with the package (``default_ckpt``), with a PEFT LoRA adapter merged in (``load_model``),
whole on every device of a mesh when one is given (``load_params``; in a job of several processes each process reads
only what its own devices hold); the architecture alone, to check a request before any weight is read
(``model_config``); and token-id files (``load_token_file``, the one reader: int32 [B, T] is B independent sequences
right-padded with -1, [T] one stream). A missing checkpoint has one wording everywhere (``checkpoint_error``). The
`k3` commands, notebooks and experiments load models through here; their flags are parsed in
``k3jax/cli/args.py``."""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.checkpoint.load import load, shipped_checkpoint
from k3jax.checkpoint.peft import load_adapter
from k3jax.config import default_run, from_hf, get_preset
from k3jax.errors import InputError
from k3jax.layers.experts import merge_trees
from k3jax.model import init_params


def checkpoint_error(path: str) -> str | None:
    """The one wording of a missing checkpoint, for every `k3` command: ``PATH: not a checkpoint directory (WHY)``
    (no such directory, a file, no config.json in it); None when ``path`` is a directory holding a config.json."""
    if not os.path.exists(path):
        why = "no such directory"
    elif not os.path.isdir(path):
        why = "a file, not a directory"
    elif not os.path.isfile(os.path.join(path, "config.json")):
        why = "no config.json in it"
    else:
        return None
    return f"{path}: not a checkpoint directory ({why})"


def require_checkpoint(path: str, flag: str = "--ckpt") -> str:
    """``path``, or an InputError naming ``flag`` in ``checkpoint_error``'s wording."""
    if (msg := checkpoint_error(path)) is not None:
        raise InputError(f"{flag} {msg}")
    return path


def default_ckpt() -> str | None:
    """The trained k3-mini shipped with the package, when present (``checkpoint.load.shipped_checkpoint``)."""
    return shipped_checkpoint()


def load_model(*, ckpt: str | None, preset: str | None, dtype: str = "float32", strict_config: bool = False,
               init_seed: int = 0, run_overrides: dict | None = None, adapter: str | None = None, mesh=None):
    """(cfg, run settings with ``dtype`` as param and compute dtype and ``run_overrides``, params) of a checkpoint
    or a preset. The run settings are the model's own (``config.default_run``: a checkpoint of a preset's
    architecture runs with that preset's).

    ``adapter``: a LoRA adapter directory in PEFT's layout (``--adapter DIR``), checked against the base's
    architecture before any base weight is read (``k3jax.checkpoint.peft.load_adapter``; a bad one raises an
    InputError naming its file); its leaves are merged into the params and the run settings carry its
    ``LoRAConfig``.

    ``mesh``: every parameter whole on every device of it (the forward-only commands' placement), read there
    (``load_params``) or drawn there (one jitted init with that output sharding), the adapter's leaves placed alike:
    global arrays, so that the same call in every process of a ``jax.distributed`` job gives one model. None: as
    ``load`` places a checkpoint, a preset's init on the default device."""
    def settings(cfg):
        return default_run(cfg, param_dtype=dtype, compute_dtype=dtype, **(run_overrides or {}))

    def with_adapter(cfg, run):
        """(lora, adapter leaves), or (None, None) without --adapter."""
        if adapter is None:
            return None, None
        lora, leaves = load_adapter(adapter, cfg, run)
        return lora, leaves if mesh is None else placed(leaves, replicated(mesh))

    if preset:
        cfg = get_preset(preset)
        if cfg.num_experts > 4096 or cfg.hidden_size > 4096:
            raise InputError(f"preset {preset!r} is too large to run here; use `k3 plan --preset {preset}`")
        run = settings(cfg)
        lora, leaves = with_adapter(cfg, run)
        # the base is drawn with the plain run settings: the same weights as without --adapter
        params = _jitted_init(None if mesh is None else replicated(mesh))(cfg, jax.random.key(init_seed), run)
        return cfg, run.replace(lora=lora), merge_trees(params, leaves)
    lora, leaves = None, None
    if adapter is not None:  # checked against config.json's architecture before any base weight is read
        cfg0 = model_config(ckpt=ckpt, preset=None, strict_config=strict_config)
        lora, leaves = with_adapter(cfg0, settings(cfg0))
    cfg, params = load_params(ckpt, dtype=dtype, strict_config=strict_config, mesh=mesh)
    return cfg, settings(cfg).replace(lora=lora), merge_trees(params, leaves)


def load_params(ckpt: str, *, cfg=None, dtype: str = "float32", strict_config: bool = False, mesh=None):
    """(cfg, params) of a checkpoint (``checkpoint.load.load``, no progress bar); with ``mesh``, every leaf whole on
    every device of it, each process of a multi-process job reading the bytes of its own devices' copies."""
    if mesh is None:
        return load(ckpt, cfg=cfg, dtype=jnp.dtype(dtype), strict_config=strict_config, progress=False)
    rep = replicated(mesh)
    return load(ckpt, cfg=cfg, mesh=mesh, shardings=lambda path, shape, dt: rep, dtype=jnp.dtype(dtype),
                strict_config=strict_config, progress=False)


def replicated(mesh) -> NamedSharding:
    """Whole on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def placed(tree, sharding):
    """Host values (NumPy or process-local arrays holding the same values in every process) as global arrays placed
    by ``sharding``: each process makes only the pieces its own devices hold (``jax.make_array_from_callback``)."""
    def one(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(one, tree)


def model_config(*, ckpt: str | None, preset: str | None, strict_config: bool = False):
    """The architecture alone (no parameters): to check a request before loading anything."""
    if preset:
        return get_preset(preset)
    return from_hf(os.path.join(require_checkpoint(ckpt), "config.json"), strict=strict_config)


@functools.cache
def _jitted_init(out_shardings=None):
    """``init_params`` jitted, its leaves placed by ``out_shardings`` (None: the default device); one compile per
    (config, run settings, placement) in a process."""
    kw = {} if out_shardings is None else {"out_shardings": out_shardings}
    return jax.jit(init_params, static_argnums=(0, 2), **kw)


class TokenRows(NamedTuple):
    """A ``--tokens`` file as ``load_token_file`` checked it.

    tokens: [B, T] int32, each row one sequence right-padded with -1 (a 1-D file is one row).
    lengths: [B] int32, the real ids of each row (``tokens[b, :lengths[b]] >= 0``, the rest -1; every row >= 1).
    stream: the file was 1-D ``[T]``: one stream, not B sequences."""

    tokens: np.ndarray
    lengths: np.ndarray
    stream: bool

    @property
    def mask(self) -> np.ndarray:
        """[B, T] bool: True at real ids, False at the -1 padding."""
        return self.tokens >= 0


def load_token_file(path: str, vocab: int, flag: str = "--tokens") -> TokenRows:
    """Read and check a token-id file (docs/cli.md): an integer .npy, never unpickled, of shape [B, T] (B
    independent sequences, ragged rows right-padded with -1) or [T] (one stream, treated as one row).

    Raises ``InputError`` naming the flag, the file and the first bad row: an unreadable or pickled file, a
    non-integer dtype, another ndim, no rows, an id < -1, an id >= ``vocab``, -1 padding followed by a real id
    (padding only at the end of a row), a row of only padding. Nothing is computed before this check."""
    def bad(msg):
        return InputError(f"{flag} {path}: {msg}")

    try:
        t = np.load(path, allow_pickle=False)
    except OSError as e:
        raise bad(f"cannot read ({e.strerror or e})") from None
    except ValueError as e:  # object arrays and pickles need unpickling: refused
        raise bad(f"not an integer .npy array readable without unpickling ({e})") from None
    if not isinstance(t, np.ndarray):
        raise bad("expected one .npy array, got an .npz archive")
    if not np.issubdtype(t.dtype, np.integer):
        raise bad(f"token ids must be integers, got dtype {t.dtype}")
    if t.ndim not in (1, 2):
        raise bad(f"expected [B, T] (B sequences) or [T] (one stream), got shape {list(t.shape)}")
    stream = t.ndim == 1
    t = t[None] if stream else t
    if t.shape[0] == 0:
        raise bad(f"no rows (shape {list(t.shape)})")

    def row(b) -> str:
        return "the [T] stream" if stream else f"row {b}"

    def first(hit):  # (row, position) of the first True in row-major order
        b, i = np.unravel_index(int(np.argmax(hit)), hit.shape)
        return int(b), int(i)

    if np.issubdtype(t.dtype, np.signedinteger) and (low := t < -1).any():
        b, i = first(low)
        raise bad(f"{row(b)}, position {i}: token id {int(t[b, i])} is negative (-1 is right padding, nothing "
                  "else below 0)")
    if (high := t >= vocab).any():
        b, i = first(high)
        raise bad(f"{row(b)}, position {i}: token id {int(t[b, i])} >= vocab {vocab}")
    real = t >= 0
    n = real.sum(axis=1)
    if (empty := n == 0).any():
        raise bad(f"{row(int(np.argmax(empty)))} is empty (only -1 padding)")
    if (inner := real != (np.arange(t.shape[1]) < n[:, None])).any():
        b, _ = first(inner)
        i = int(np.argmin(real[b]))
        j = i + int(np.argmax(real[b, i:]))
        raise bad(f"{row(b)}: -1 at position {i} is followed by token id {int(t[b, j])} at position {j} (-1 is "
                  "right padding only: it may end a row, not sit inside it)")
    return TokenRows(t.astype(np.int32), n.astype(np.int32), stream)


__all__ = ["TokenRows", "checkpoint_error", "default_ckpt", "load_model", "load_params", "load_token_file",
           "model_config", "placed", "replicated", "require_checkpoint"]
