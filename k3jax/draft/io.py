"""A draft on disk in the published DSpark layout: ``config.json`` (``DraftConfig.to_hf``) and ``model.safetensors``
(or shards named by ``model.safetensors.index.json``), tensors named as the published checkpoint names them (no
``model.`` prefix, torch [out, in] orientation).

    save_draft("drafts/k3-tiny", model, dcfg)                         # bf16; atomic: all or nothing
    model, dcfg = load_draft("drafts/k3-tiny", target_cfg=cfg)        # DraftMismatchError before any weight is read
    draft_tensor_shapes(dcfg)                                         # {HF name: torch shape}

The target's embedding is not part of a draft (the draft reads the target's own); the published checkpoint ships a
frozen copy as ``embed_tokens.weight``, which ``load_draft`` accepts and ignores (as it does an ``lm_head.`` copy),
listing them in ``report["ignored"]``. ``save_draft`` writes it only when given ``embed``. Files are read with
safetensors' NumPy API: tensors only, never a pickle.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from k3jax.checkpoint.atomic import staged_dir
from k3jax.draft.config import DraftConfig, check_target
from k3jax.draft.network import DraftModel
from k3jax.errors import InputError
from k3jax.layers.common import HFLeaf

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
IGNORED_PREFIXES = ("embed_tokens.", "lm_head.")   # copies of the target's own tensors
_SAVE_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def _leaves(module, prefix: str = "", path: tuple = ()):
    """(HF name, state path, HFLeaf) of every parameter, walking the blocks' ``HF`` tables."""
    for attr, entry in type(module).HF.items():
        if not hasattr(module, attr):
            continue
        sub = getattr(module, attr)
        if isinstance(entry, HFLeaf):
            yield prefix + entry.suffix, path + (attr,), entry
        elif isinstance(sub, nnx.List):
            for i, child in enumerate(sub):
                yield from _leaves(child, f"{prefix}{entry}{i}.", path + (attr, i))
        else:
            yield from _leaves(sub, prefix + entry, path + (attr,))


def _torch_shape(shape: tuple, leaf: HFLeaf) -> tuple:
    if leaf.transform == "copy":
        return tuple(shape)
    if leaf.transform == "row":
        return (1, *shape)
    if leaf.transform == "linear":
        return math.prod(shape[leaf.in_axes:]), math.prod(shape[:leaf.in_axes])
    raise ValueError(f"no draft tensor uses the {leaf.transform!r} transform")


def _to_torch(a: np.ndarray, leaf: HFLeaf) -> np.ndarray:
    t = a.reshape(_torch_shape(a.shape, leaf)[::-1]).T if leaf.transform == "linear" else a
    return np.ascontiguousarray(t.reshape(_torch_shape(a.shape, leaf)))


def _from_torch(t: np.ndarray, shape: tuple, leaf: HFLeaf) -> np.ndarray:
    return (t.T if leaf.transform == "linear" else t).reshape(shape)


def _abstract(dcfg: DraftConfig, dtype=jnp.float32, compute_dtype=None) -> DraftModel:
    return nnx.eval_shape(lambda: DraftModel(dcfg, dtype=dtype, compute_dtype=compute_dtype, rngs=nnx.Rngs(0)))


def draft_tensor_shapes(dcfg: DraftConfig, *, embed: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the draft's checkpoint: HF name → torch shape (``embed_tokens.weight`` [W, Dt] with
    ``embed``)."""
    model = _abstract(dcfg)
    out = {name: _torch_shape(_get(model, path).shape, leaf) for name, path, leaf in _leaves(model)}
    if embed:
        out["embed_tokens.weight"] = (dcfg.vocab_size, dcfg.target_hidden_size)
    return dict(sorted(out.items()))


def _get(module, path):
    for k in path:
        module = module[k] if isinstance(k, int) else getattr(module, k)
    return module


def save_draft(out_dir, model: DraftModel, dcfg: DraftConfig, *, dtype: str = "bfloat16", embed=None,
               overwrite: bool = False) -> str:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir`` (whole or not at all; an existing non-empty
    directory only with ``overwrite``). ``dtype``: "bfloat16" (the published form) or "float32"; ``embed`` [W, Dt]:
    also write it as ``embed_tokens.weight``. Returns the directory's absolute path."""
    if dtype not in _SAVE_DTYPES:
        raise InputError(f"draft dtype {dtype!r}: must be one of {sorted(_SAVE_DTYPES)}")
    if model.dcfg != dcfg:
        raise ValueError("save_draft: the model was built for another DraftConfig")
    np_dtype = _SAVE_DTYPES[dtype]
    tensors = {name: _to_torch(np.asarray(jax.device_get(_get(model, path)[...]), np.float32), leaf).astype(np_dtype)
               for name, path, leaf in _leaves(model)}
    if embed is not None:
        tensors["embed_tokens.weight"] = np.asarray(jax.device_get(embed), np.float32).astype(np_dtype)
    with staged_dir(out_dir, overwrite=overwrite) as tmp:
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(dcfg.to_hf(torch_dtype=dtype), f, indent=2)
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
    return os.path.abspath(os.fspath(out_dir))


def read_draft_config(in_dir, *, report: dict | None = None) -> DraftConfig:
    """The ``DraftConfig`` of a draft directory (InputError naming the file when missing or malformed)."""
    path = os.path.join(os.fspath(in_dir), CONFIG)
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{path}: no draft config (expected {CONFIG} in {in_dir})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    return DraftConfig.from_hf(d, source=path, report=report)


def _weight_files(in_dir: str) -> list[str]:
    index = os.path.join(in_dir, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{index}: not a safetensors index ({e})") from None
        bad = [n for n in files if not isinstance(n, str) or os.path.basename(n) != n]
        if bad:
            raise InputError(f"{index}: shard names must be plain file names, got {bad}")
        return [os.path.join(in_dir, n) for n in files]
    path = os.path.join(in_dir, WEIGHTS)
    if not os.path.exists(path):
        raise InputError(f"{in_dir}: no draft weights ({WEIGHTS} or {INDEX})")
    return [path]


def load_draft(in_dir, *, target_cfg, dtype=jnp.float32, compute_dtype=None,
               report: dict | None = None) -> tuple[DraftModel, DraftConfig]:
    """Read a draft written by ``save_draft`` (or the published DSpark layout) for the target ``target_cfg``.

    Order: the config (strict, ``DraftConfig.from_hf``), the target identity (``check_target``: a
    ``DraftMismatchError`` before any weight is read), every file's tensor names and shapes (an InputError naming
    the file and the tensor: unknown, missing, duplicated, a wrong shape or a non-float dtype), then the weights.
    ``dtype``: the parameters' dtype; ``compute_dtype``: the model's (default ``dtype``). ``report`` (a dict), if
    given, gets "extra_keys" (config keys k3jax does not use), "ignored" (tensors accepted and skipped: target
    copies) and "dtypes" (stored dtype → tensor count)."""
    in_dir = os.fspath(in_dir)
    rep = {} if report is None else report
    dcfg = read_draft_config(in_dir, report=rep)
    check_target(dcfg, target_cfg)
    model = _abstract(dcfg, dtype, compute_dtype)
    want = {name: (path, leaf, _get(model, path).shape) for name, path, leaf in _leaves(model)}
    where, ignored, dtypes = {}, [], {}
    files = _weight_files(in_dir)
    for file in files:
        try:
            with safe_open(file, framework="np") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    if name in where:
                        raise InputError(f"{file}: tensor {name} also in {where[name]}")
                    where[name] = file
                    if name.startswith(IGNORED_PREFIXES):
                        ignored.append(name)
                        continue
                    if name not in want:
                        raise InputError(f"{file}: tensor {name} is not a tensor of this draft "
                                         f"({dcfg.num_hidden_layers} layers)")
                    shape, expect = tuple(sl.get_shape()), _torch_shape(want[name][2], want[name][1])
                    if shape != expect:
                        raise InputError(f"{file}: tensor {name} has shape {list(shape)}, expected {list(expect)}")
                    kind = sl.get_dtype()
                    if kind not in ("BF16", "F16", "F32", "F64"):
                        raise InputError(f"{file}: tensor {name} has dtype {kind}, expected a float type")
                    dtypes[kind] = dtypes.get(kind, 0) + 1
        except SafetensorError as e:
            raise InputError(f"{file}: not a readable safetensors file ({e})") from None
    missing = sorted(set(want) - set(where))
    if missing:
        raise InputError(f"{in_dir}: draft tensor {missing[0]} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    state = nnx.state(model, nnx.Param)
    pure = state.to_pure_dict()
    for file in files:
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                if name in want:
                    path, leaf, shape = want[name]
                    node = pure
                    for k in path[:-1]:
                        node = node[k]
                    node[path[-1]] = jnp.asarray(_from_torch(f.get_tensor(name), shape, leaf).astype(np.float32),
                                                 dtype)
    state.replace_by_pure_dict(pure)
    rep.update(ignored=sorted(ignored), dtypes=dict(sorted(dtypes.items())))
    return nnx.merge(nnx.graphdef(model), state), dcfg


__all__ = ["CONFIG", "IGNORED_PREFIXES", "INDEX", "WEIGHTS", "draft_tensor_shapes", "load_draft",
           "read_draft_config", "save_draft"]
