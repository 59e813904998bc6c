"""Where a CLI command's model comes from: ``--ckpt DIR`` (loaded), ``--preset NAME`` (random init) or the
trained k3-mini shipped with the package (``default_ckpt``)."""

from __future__ import annotations

import functools
import os

from k3jax.errors import InputError


def default_ckpt() -> str | None:
    """The trained k3-mini shipped with the package, when present."""
    p = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "k3-mini-stdlib")
    return p if os.path.exists(os.path.join(p, "config.json")) else None


def load_model(*, ckpt: str | None, preset: str | None, dtype: str = "float32", strict_config: bool = False,
               init_seed: int = 0, run_overrides: dict | None = None):
    """(cfg, run settings with ``dtype`` as param and compute dtype and ``run_overrides``, params) of a checkpoint
    or a preset. The run settings are the model's own (``config.default_run``: a checkpoint of a preset's
    architecture runs with that preset's)."""
    import jax
    import jax.numpy as jnp

    from k3jax.config import default_run, get_preset

    if preset:
        from k3jax.model import init_params

        cfg = get_preset(preset)
        if cfg.num_experts > 4096 or cfg.hidden_size > 4096:
            raise InputError(f"preset {preset!r} is too large to run here; use `k3 plan --preset {preset}`")
        run = default_run(cfg, param_dtype=dtype, compute_dtype=dtype, **(run_overrides or {}))
        return cfg, run, _jit_init(init_params)(cfg, jax.random.key(init_seed), run)
    from k3jax.checkpoint.load import load

    cfg, params = load(ckpt, dtype=jnp.dtype(dtype), strict_config=strict_config, progress=False)
    return cfg, default_run(cfg, param_dtype=dtype, compute_dtype=dtype, **(run_overrides or {})), params


def load_token_file(path: str, flag: str = "--tokens"):
    """An integer .npy array of token ids (never unpickled); errors name the flag and the file."""
    import numpy as np

    try:
        t = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path}: cannot read ({e})") from None
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"{flag} {path}: ids must be integers, got {t.dtype}")
    return t


@functools.cache
def _jit_init(init_params):
    import jax

    return jax.jit(init_params, static_argnums=(0, 2))  # one compile per (config, run settings) in a process


def model_config(*, ckpt: str | None, preset: str | None, strict_config: bool = False):
    """The architecture alone (no parameters): to check a request before loading anything."""
    from k3jax.config import get_preset
    from k3jax.hf_config import from_hf

    if preset:
        return get_preset(preset)
    path = os.path.join(ckpt, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"{ckpt}: no config.json (not a checkpoint directory)")
    return from_hf(path, strict=strict_config)


__all__ = ["default_ckpt", "load_model", "load_token_file", "model_config"]
