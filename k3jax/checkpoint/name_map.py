"""k3jax parameter leaves ↔ official HF tensors (docs/model.md §2.1, docs/checkpoint.md §11, docs/model.md §13), read
from the blocks' own tables.

Each block class (k3jax/layers/*, k3jax/model/decoder.py, k3jax/model/network.py) keeps ``HF``: per parameter its
HF suffix and transform, per sub-block its infix. This module walks them over the abstract model, so a leaf added
to a block is listed here with no edit. Paths are in the per-layer view (k3jax/model/layout.py): a decoder layer's
leaves are ``("layers", l, ...)`` whether or not the state stacks that layer (``layout.leaf_location`` maps them).

Two layouts, picked by ``default_layout(cfg)`` (or passed explicitly):

- ``"k3"``: the official Kimi K3 release — ``language_model.`` prefix, routed experts as compressed-tensors MXFP4
  (``weight_packed`` U8 [out, in/2] + ``weight_scale`` U8 [out, in/32]), ``A_log`` F32 zero-padded to a multiple of
  128, KDA convs / ``o_norm`` F32. Shard k = 1..L holds layer k-1, shard L+1 the five model-level tensors; the full
  K3 config adds the two vision shards (96 files in all).
- ``"kimi-linear"``: HF Kimi-Linear (``model.layers.*``, ``lm_head.weight``), ``A_log`` F32 [1, 1, H, 1], BF16
  convs and ``o_norm``, BF16 experts ``experts.{e}.w{1,2,3}.weight``. Its official shard split is not known here;
  ``shard_of`` uses the K3 rule (one layer per shard) as the k3jax writer convention. Dtypes not pinned by
  docs/model.md §13 are assumptions: ``dt_bias`` and ``e_score_correction_bias`` F32, ``o_norm`` BF16 (loaders
  should trust the header's dtype and cast).

The expert storage follows ``cfg.expert_format`` ("mxfp4" or "bf16") in either layout.

``hf_tensors(cfg)`` lists every checkpoint tensor as a ``TensorSpec`` in on-disk order (per shard: F32, BF16, U8,
byte order of names within a dtype). ``leaf_from_hf`` / ``leaf_to_hf`` are the numpy transforms per tensor.

    >>> from k3jax.config import get_preset
    >>> specs = hf_tensors(get_preset("k3-mini"))
    >>> s = next(s for s in specs if s.path == ("layers", 0, "kda", "wq"))
    >>> s.name, s.dtype, s.shape, s.transform
    ('language_model.model.layers.0.self_attn.q_proj.weight', 'BF16', (384, 384), 'linear')
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from k3jax.checkpoint.safetensors_layout import nbytes, order_key, shard_file_name
from k3jax.config import K3Config
from k3jax.errors import InputError
from k3jax.model import abstract_model
from k3jax.model import layout as model_layout  # `layout` is this module's parameter name (the HF layout)
from k3jax.ops.mx import BLOCK_SIZE, mxfp4_packed_shapes
from k3jax.quant import mxfp4_pack, mxfp4_unpack

Path = tuple  # a path into the params tree, e.g. ("layers", 3, "kda", "wq")

A_LOG_PAD = 128  # the release pads A_log to a multiple of this (96 real heads + 32 zeros)
VISION_SHARDS = 2  # shards 95 (mm_projector) and 96 (vision_tower) of the full K3 release


class TensorSpec(NamedTuple):
    """One checkpoint tensor and the k3jax leaf it belongs to.

    transform (leaf ← HF):
      copy       same shape
      linear     leaf [*in, *out] ← torch [prod(out), prod(in)]; ``in_axes`` leading leaf axes are the input
      row        leaf [d] ← [1, d]
      conv       leaf [C, W] ← [C, 1, W]
      flat       leaf [N, K] ← [N*K]
      a_log_pad  leaf [H] ← [ceil(H/128)*128] (written); on load any vector form of N >= H values, tail exactly 0
      a_log_4d   leaf [H] ← [1, 1, H, 1]
      expert     leaf[e] [in, out] ← torch [out, in] (BF16 ``.weight``)
      mxfp4      leaf[e] [in, out] ← ``weight_packed`` [out, in/2] + ``weight_scale`` [out, in/32] (``part``)
    """

    name: str
    dtype: str  # "F32" | "BF16" | "U8"
    shape: tuple[int, ...]  # HF shape
    path: Path  # k3jax leaf
    transform: str
    layer: int | None = None  # 0-based decoder layer, None for model-level tensors
    in_axes: int = 1  # for "linear"
    expert: int | None = None  # routed expert id for expert / mxfp4
    part: str | None = None  # "packed" | "scale" for mxfp4

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)

    @property
    def num_params(self) -> int:
        """Weights stored in this tensor: packed U8 holds 2 per byte, E8M0 scales count 0, A_log pad counts."""
        n = math.prod(self.shape)
        return 2 * n if self.part == "packed" else 0 if self.part == "scale" else n


# ------------------------------------------------------------------------------- the blocks' tables, walked

EXPERT_LEAVES = ("w1", "w2", "w3")  # moe.experts.w [E, in, out] ↔ "experts.{e}.{w}.*"
LAYOUTS = {
    # prefix, A_log transform, dtype of the "F32k3" leaves
    "k3": ("language_model.", "a_log_pad", "F32"),
    "kimi-linear": ("", "a_log_4d", "BF16"),
}


def default_layout(cfg: K3Config) -> str:
    """K3-shaped configs (AttnRes) use the official K3 layout; the rest the HF Kimi-Linear one."""
    return "k3" if cfg.uses_attn_res else "kimi-linear"


# ------------------------------------------------------------------------------------------------ shape helpers

def hf_shape(transform: str, leaf_shape: Sequence[int], in_axes: int = 1) -> tuple[int, ...]:
    s = tuple(int(x) for x in leaf_shape)
    if transform == "copy":
        return s
    if transform == "linear":
        return (math.prod(s[in_axes:]), math.prod(s[:in_axes]))
    if transform == "row":
        return (1, *s)
    if transform == "conv":
        return (s[0], 1, s[1])
    if transform == "flat":
        return (math.prod(s),)
    if transform == "a_log_pad":
        return (-(-s[0] // A_LOG_PAD) * A_LOG_PAD,)
    if transform == "a_log_4d":
        return (1, 1, s[0], 1)
    raise ValueError(f"unknown transform {transform!r}")


def mxfp4_shapes(in_dim: int, out_dim: int, name: str = "expert") -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed, scale) shapes of one MXFP4 matrix with torch shape [out, in]."""
    if in_dim % BLOCK_SIZE:
        raise InputError(f"{name}: input width {in_dim} is not a multiple of the MXFP4 group {BLOCK_SIZE}; "
                         "store the experts as bf16 (expert_format='bf16')")
    return mxfp4_packed_shapes((out_dim, in_dim))


class HFLeafEntry(NamedTuple):
    """One parameter of the model as the walk of the blocks' ``HF`` tables finds it."""

    path: Path  # per-layer-view path: ("layers", l, ...) or a model-level path
    name: str  # HF name after the layout prefix (expert tensors: the prefix of "{e}.{w}.*")
    rule: object  # k3jax.layers.common.HFLeaf
    shape: tuple[int, ...]  # the leaf's shape (one layer's, for stacked leaves)


def _walk(module, name: str, path: Path, stacked: bool):
    """Yield an HFLeafEntry for every Param under ``module``, reading each block class's ``HF`` table."""
    from flax import nnx

    table = getattr(type(module), "HF", None)
    if table is None:
        raise KeyError(f"name map: block {type(module).__name__} has no HF table")
    for attr, value in vars(module).items():
        if isinstance(value, nnx.Param):
            if attr not in table:
                raise KeyError(f"name map: {type(module).__name__}.HF has no entry for leaf {attr!r} "
                               f"({'/'.join(map(str, (*path, attr)))})")
            shape = tuple(value.shape)[1:] if stacked else tuple(value.shape)
            yield HFLeafEntry((*path, attr), name + table[attr].suffix, table[attr], shape)
        elif isinstance(value, nnx.Module):
            if attr not in table:
                raise KeyError(f"name map: {type(module).__name__}.HF has no entry for block {attr!r}")
            if table[attr] is not None:  # None: decoder layers, named by layer index (model/layout.py)
                yield from _walk(value, name + table[attr], (*path, attr), stacked)


@functools.lru_cache(maxsize=16)
def _entries(cfg: K3Config) -> tuple[tuple[HFLeafEntry, ...], dict[int, tuple[HFLeafEntry, ...]]]:
    """(model-level entries, {layer: entries}) from the abstract model (``nnx.eval_shape``, no memory)."""
    model = abstract_model(cfg)
    lay = model_layout(cfg)
    glob = tuple(_walk(model, "", (), False))
    layers = {}
    for l in range(cfg.num_layers):
        (section, *rest), g = lay.locate(l)
        module = getattr(model, section)
        for k in rest:
            module = getattr(module, k) if isinstance(k, str) else module[k]
        layers[l] = tuple(_walk(module, f"model.layers.{l}.", ("layers", l), g is not None))
    return glob, layers


def leaf_shapes(cfg: K3Config) -> dict[Path, tuple[int, ...]]:
    """``{per-layer-view path: shape}`` for every parameter (allocates nothing)."""
    glob, layers = _entries(cfg)
    return {e.path: e.shape for e in (*glob, *(e for es in layers.values() for e in es))}


# ---------------------------------------------------------------------------------------------------- listing

def _spec(layout: str, e: HFLeafEntry, layer) -> TensorSpec:
    rule = e.rule
    transform = LAYOUTS[layout][1] if rule.transform == "A_log" else rule.transform
    dtype = LAYOUTS[layout][2] if rule.dtype == "F32k3" else rule.dtype
    name = LAYOUTS[layout][0] + e.name
    return TensorSpec(name, dtype, hf_shape(transform, e.shape, rule.in_axes), e.path, transform, layer, rule.in_axes)


def layer_tensors(cfg: K3Config, l: int, layout: str | None = None, expert_format: str | None = None
                  ) -> list[TensorSpec]:
    """The tensors of decoder layer ``l`` in on-disk order (F32, BF16, U8; byte order of names)."""
    layout = layout or default_layout(cfg)
    fmt = expert_format or cfg.expert_format
    out = []
    for e in _entries(cfg)[1][l]:
        if e.rule.transform == "expert":
            out += _expert_tensors(e, LAYOUTS[layout][0] + e.name[: -len(e.rule.suffix)], l, fmt)
        else:
            out.append(_spec(layout, e, l))
    out.sort(key=lambda s: order_key(s.name, s.dtype))
    return out


def _expert_tensors(e: HFLeafEntry, pre: str, l: int, fmt: str) -> list[TensorSpec]:
    w, path = e.rule.suffix, e.path
    E, din, dout = e.shape
    if fmt == "mxfp4":
        pshape, sshape = mxfp4_shapes(din, dout, f"layer {l} experts.{w}")
        out = []
        for x in range(E):
            out.append(TensorSpec(f"{pre}{x}.{w}.weight_packed", "U8", pshape, path, "mxfp4", l, 1, x, "packed"))
            out.append(TensorSpec(f"{pre}{x}.{w}.weight_scale", "U8", sshape, path, "mxfp4", l, 1, x, "scale"))
        return out
    if fmt == "bf16":
        return [TensorSpec(f"{pre}{x}.{w}.weight", "BF16", (dout, din), path, "expert", l, 1, x) for x in range(E)]
    raise InputError(f"unknown expert_format {fmt!r}; known: mxfp4, bf16")


def global_tensors(cfg: K3Config, layout: str | None = None) -> list[TensorSpec]:
    """The model-level tensors (one shard after the layers), in on-disk order."""
    layout = layout or default_layout(cfg)
    out = [_spec(layout, e, None) for e in _entries(cfg)[0]]
    out.sort(key=lambda s: order_key(s.name, s.dtype))
    return out


def hf_tensors(cfg: K3Config, layout: str | None = None, expert_format: str | None = None) -> list[TensorSpec]:
    """Every text tensor of the checkpoint in official on-disk order: layers' shards 1..L, then the globals."""
    out = []
    for l in range(cfg.num_layers):
        out += layer_tensors(cfg, l, layout, expert_format)
    return out + global_tensors(cfg, layout)


def shard_tensors(cfg: K3Config, layout: str | None = None, expert_format: str | None = None
                  ) -> list[tuple[str, list[TensorSpec]]]:
    """``[(file name, tensors in header order)]`` for the text shards 1..L+1."""
    total = num_shards(cfg, layout)
    out = [(shard_file_name(l + 1, total), layer_tensors(cfg, l, layout, expert_format))
           for l in range(cfg.num_layers)]
    out.append((shard_file_name(cfg.num_layers + 1, total), global_tensors(cfg, layout)))
    return out


# ----------------------------------------------------------------------------------------------------- shards

def has_vision_shards(cfg: K3Config, layout: str | None = None) -> bool:
    """The full-size K3 release carries two vision shards after the text ones (96 files in all)."""
    return (layout or default_layout(cfg)) == "k3" and (cfg.hidden_size, cfg.num_layers) == (7168, 93)


def num_shards(cfg: K3Config, layout: str | None = None) -> int:
    return cfg.num_layers + 1 + (VISION_SHARDS if has_vision_shards(cfg, layout) else 0)


_LAYER_RE = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")


def shard_of(name: str, cfg: K3Config, layout: str | None = None) -> int:
    """1-based shard number of an HF tensor name: layer l → l + 1, model-level → L + 1, vision → L + 2 / L + 3."""
    layout = layout or default_layout(cfg)
    m = _LAYER_RE.match(name)
    if m and name.startswith(LAYOUTS[layout][0]):
        l = int(m.group(1))
        if l >= cfg.num_layers:
            raise InputError(f"tensor {name!r}: layer {l} does not exist ({cfg.num_layers} layers)")
        return l + 1
    if has_vision_shards(cfg, layout):
        if name.startswith("mm_projector."):
            return cfg.num_layers + 2
        if name.startswith("vision_tower."):
            return cfg.num_layers + 3
    if name in {s.name for s in global_tensors(cfg, layout)}:
        return cfg.num_layers + 1
    raise InputError(f"tensor {name!r} is not a {layout}-layout tensor of this config")


def shard_file_of(name: str, cfg: K3Config, layout: str | None = None) -> str:
    return shard_file_name(shard_of(name, cfg, layout), num_shards(cfg, layout))


# ------------------------------------------------------------------------------------------------ conversions

_NP_DTYPES = {"F32": np.float32, "U8": np.uint8}


def np_dtype(hf_dtype: str):
    if hf_dtype == "BF16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return _NP_DTYPES[hf_dtype]


def leaf_shape(spec: TensorSpec, cfg: K3Config) -> tuple[int, ...]:
    """Shape of the k3jax leaf ``spec`` belongs to (one layer's; the whole [E, in, out] stack for experts)."""
    return leaf_shapes(cfg)[spec.path]


def leaf_from_hf(array, spec: TensorSpec, shape: Sequence[int]) -> np.ndarray:
    """HF tensor → k3jax leaf value (numpy, HF dtype kept). ``shape`` is the leaf shape; for a BF16 expert it is
    the one-expert [in, out] slice. MXFP4 pairs go through ``expert_from_hf``."""
    a = np.asarray(array)
    if tuple(a.shape) != spec.shape:
        raise InputError(f"{spec.name}: checkpoint shape {tuple(a.shape)} != expected {spec.shape}")
    t = spec.transform
    if t == "mxfp4":
        raise ValueError(f"{spec.name}: MXFP4 tensors come in pairs; use expert_from_hf(packed, scale, ...)")
    if t in ("linear", "expert"):
        return a.T.reshape(shape)
    if t == "a_log_pad":  # any vector form of >= H values (docs/model.md §2.1: [H], [1, 1, H, 1], zero-padded [128])
        H, a = shape[0], a.reshape(-1)
        if np.any(a[H:] != 0):
            raise InputError(f"{spec.name}: A_log padding [{H}:] must be exactly 0 (got non-zero entries)")
        return a[:H].copy()
    return a.reshape(shape)  # copy, row, conv, flat, a_log_4d


def leaf_to_hf(value, spec: TensorSpec) -> np.ndarray:
    """k3jax leaf value → HF tensor in the checkpoint dtype. For a BF16 expert pass the whole [E, in, out] stack
    (or one [in, out] slice); MXFP4 pairs go through ``expert_to_hf``."""
    x = np.asarray(value)
    t = spec.transform
    if t == "mxfp4":
        raise ValueError(f"{spec.name}: MXFP4 tensors come in pairs; use expert_to_hf(stack, spec, ...)")
    if t == "linear":
        out = x.reshape(math.prod(x.shape[:spec.in_axes]), -1).T
    elif t == "expert":
        out = (x[spec.expert] if x.ndim == 3 else x).T
    elif t == "a_log_pad":
        out = np.zeros(spec.shape, x.dtype)
        out[: x.shape[0]] = x
    else:
        out = x.reshape(spec.shape)
    if tuple(out.shape) != spec.shape:
        raise ValueError(f"{spec.name}: leaf of shape {tuple(x.shape)} gives {tuple(out.shape)}, expected {spec.shape}")
    return np.ascontiguousarray(out.astype(np_dtype(spec.dtype)))


def expert_from_hf(packed, scale, spec: TensorSpec) -> np.ndarray:
    """One MXFP4 expert matrix → dense [in, out] float32 (needs ``k3jax.quant.mxfp4_unpack(packed, scale)``
    returning the torch-oriented [out, in] values)."""
    return np.asarray(mxfp4_unpack(np.asarray(packed), np.asarray(scale)), np.float32).T


def expert_to_hf(weight, spec: TensorSpec) -> tuple[np.ndarray, np.ndarray]:
    """One dense [in, out] expert matrix (or the [E, in, out] stack, sliced at ``spec.expert``) → (packed, scale)
    U8 via ``k3jax.quant.mxfp4_pack`` on the torch-oriented [out, in] matrix."""
    w = np.asarray(weight)
    w = w[spec.expert] if w.ndim == 3 else w
    packed, scale = mxfp4_pack(w.T)
    return np.asarray(packed, np.uint8), np.asarray(scale, np.uint8)


__all__ = ["TensorSpec", "HFLeafEntry", "LAYOUTS", "default_layout", "hf_tensors", "layer_tensors", "global_tensors",
           "shard_tensors", "shard_of", "shard_file_of", "num_shards", "has_vision_shards", "hf_shape",
           "mxfp4_shapes", "leaf_shapes", "leaf_shape", "leaf_from_hf", "leaf_to_hf", "expert_from_hf",
           "expert_to_hf", "np_dtype"]
