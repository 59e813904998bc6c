"""LoRA adapters in PEFT's layout (HF ``peft``): k3jax adapter leaves (k3jax/layers/lora.py) to and from a directory.

    save_adapter(params, cfg, run, "adapter/")            # adapter_config.json, adapter_model.safetensors, sidecar
    lora, leaves = load_adapter("adapter/", cfg, run)      # LoRAConfig, the adapter leaves as a params-shaped dict
    logits = forward(merge_trees(params, leaves), tokens, cfg, run.replace(lora=lora))

Key rule. Each tensor the name map lists for an adapted leaf W (``name_map.hf_tensors``: one per linear weight, one
per routed expert) is one HF ``nn.Linear``; its module is the tensor's name less its last component
(``...self_attn.q_proj.weight`` → ``...self_attn.q_proj``; ``...experts.3.w1.weight_packed`` → ``...experts.3.w1``),
renamed where transformers' own module tree names it otherwise (``MODULE_RENAMES``, per name-map layout): its
KimiLinear (transformers ≥ 5) holds the MoE block as ``mlp``, so on the "kimi-linear" layout the shared experts are
``model.layers.{l}.mlp.shared_experts.{gate,up,down}_proj`` (checkpoint: ``block_sparse_moe.shared_experts``).
Routed experts keep the checkpoint's names (``block_sparse_moe.experts.{e}.w{1,2,3}``, the release's own modelling
code): transformers fuses them into 3-D parameters, with no per-expert module. Loading accepts either spelling of a
module (not both). With W's adapter A [*in, r], B [r, *out] (that layer's row of a stack, that expert's slice of an
expert stack):

    base_model.model.<module>.lora_A.weight   [r, prod(in)]    A.reshape(prod(in), r).T
    base_model.model.<module>.lora_B.weight   [prod(out), r]   B.reshape(r, prod(out)).T

i.e. the name map's own ``linear`` transform on A (``in_axes`` = W's input dims) and on B (``in_axes`` 1), so PEFT's
delta ``lora_B @ lora_A * (lora_alpha / r)`` is ``leaf_to_hf`` of the leaf delta scale · A B (HF's [out, in]).

Which leaves a target group ("attn", "shared", "dense", "experts") covers is read from the model itself
(``abstract_params`` with that one target: ``DecoderLayer.add_lora`` decides), never from a second table. Loading
derives the targets from the modules present; k3jax adapters are all-or-nothing per group, so a group only partly
covered is refused, naming its first missing module. Reading never unpickles (safetensors only). Anything k3jax
would apply differently from PEFT is refused, naming the file and the field or tensor: another ``peft_type``,
rsLoRA, ``fan_in_fan_out``, DoRA, bias or ``modules_to_save`` entries, per-module rank/alpha patterns,
unknown keys, modules the base lacks, wrong shapes. ``k3jax_adapter.json`` (written beside PEFT's files, optional
on load) keeps the base's architecture, so an adapter for another base is refused with the fields that differ.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.atomic import check_out_dir, staged_dir
from k3jax.checkpoint.container import PICKLE_SUFFIXES, read_header
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.io import Checkpoint
from k3jax.checkpoint.save import write_shard
from k3jax.config import LORA_TARGETS, K3Config, LoRAConfig, RunConfig, architecture, architecture_diff
from k3jax.distributed import any_process, host_value, is_main
from k3jax.layers.lora import adapter_names, is_adapter
from k3jax.model import abstract_params, leaf_location
from k3jax.pytree import get_path, key_names, set_path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SIDECAR = "k3jax_adapter.json"
PREFIX = "base_model.model."
# PEFT saves "<module>.lora_A.weight"; a state dict taken with the adapter name left in has "lora_A.<name>.weight"
KEY_RE = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
REQUIRED = ("peft_type", "r", "lora_alpha", "target_modules")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # what a factor may be stored as (cast to the run's param dtype)
# transformers' module names where they differ from the checkpoint's tensor names, per name-map layout (not applied to
# routed experts). KimiLinear's conversion_mapping renames ".block_sparse_moe." to ".mlp." on load (back on save).
MODULE_RENAMES = {"kimi-linear": ((".block_sparse_moe.", ".mlp."),), "k3": ()}


class Module(NamedTuple):
    """One adaptable HF module of a base: ``a_path`` is W_lora_a's per-layer-view path (B: ``_lora_b``)."""

    name: str  # HF module name, e.g. "language_model.model.layers.0.self_attn.q_proj"
    target: str  # its LoRAConfig target group
    a_path: tuple
    b_path: tuple
    expert: int | None  # routed expert id (its slice of the stack's factors)
    a_shape: tuple  # [*in, r] of this module
    b_shape: tuple  # [r, *out]
    alias: str | None = None  # the checkpoint-tensor spelling of ``name``, where MODULE_RENAMES changed it


def _adapter_leaves(cfg: K3Config, run: RunConfig, rank: int, target: str) -> dict:
    """``{state path: ShapeDtypeStruct}`` of the adapter leaves a rank-``rank`` adapter on ``target`` adds."""
    tree = abstract_params(cfg, run.replace(lora=LoRAConfig(rank=rank, targets=(target,))))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {key_names(p): s for p, s in flat if is_adapter(key_names(p)[-1])}


def modules(cfg: K3Config, run: RunConfig, rank: int) -> list[Module]:
    """Every module a rank-``rank`` adapter can hold on this base, in the name map's order (layer, then name)."""
    leaves = {t: _adapter_leaves(cfg, run, rank, t) for t in LORA_TARGETS}
    renames = MODULE_RENAMES[nm.default_layout(cfg)]
    out = []
    for spec in nm.hf_tensors(cfg):
        if spec.transform not in ("linear", "expert") and spec.part != "packed":
            continue
        names = adapter_names(spec.path[-1])
        a_path, b_path = ((*spec.path[:-1], n) for n in names)
        (a_loc, g), (b_loc, _) = leaf_location(a_path, cfg), leaf_location(b_path, cfg)
        target = next((t for t in LORA_TARGETS if a_loc in leaves[t]), None)
        if target is None:
            continue
        drop = (g is not None) + (spec.expert is not None)  # the stack's layers axis, the expert axis
        tensor_module = name = spec.name.rsplit(".", 1)[0]
        for old, new in (renames if spec.expert is None else ()):
            name = name.replace(old, new)
        out.append(Module(name, target, a_path, b_path, spec.expert, tuple(leaves[target][a_loc].shape[drop:]),
                          tuple(leaves[target][b_loc].shape[drop:]), None if name == tensor_module else tensor_module))
    return out


def factor_spec(m: Module, factor: str, dtype: str) -> nm.TensorSpec:
    """The PEFT tensor of ``m``'s factor "A" or "B" as a name-map ``linear`` spec (leaf ↔ tensor transforms)."""
    s = m.a_shape if factor == "A" else m.b_shape
    if factor == "A":  # [*in, r] -> [r, prod(in)]
        hf, in_axes, path = (s[-1], math.prod(s[:-1])), len(s) - 1, m.a_path
    else:  # [r, *out] -> [prod(out), r]
        hf, in_axes, path = (math.prod(s[1:]), s[0]), 1, m.b_path
    return nm.TensorSpec(f"{PREFIX}{m.name}.lora_{factor}.weight", dtype, hf, path, "linear", None, in_axes)


# ------------------------------------------------------------------------------------------------------- save

def save_adapter(params, cfg: K3Config, run: RunConfig, out_dir, *, base: str | None = None,
                 overwrite: bool = False) -> dict:
    """Write the adapter leaves of ``params`` (keys ending ``_lora_a`` / ``_lora_b``; base leaves are ignored) for
    ``run.lora`` as a PEFT LoRA adapter directory, atomically (temp dir + rename; an existing non-empty
    ``out_dir`` is replaced only with ``overwrite``). Factors are stored in their own dtype (BF16, else F32).
    Returns {"dir", "modules", "tensors"}."""
    lora = run.lora
    if lora is None:
        raise CheckpointError("run.lora is None: no adapter to save")
    check_out_dir(out_dir, overwrite=overwrite)  # before any leaf is read
    mods = [m for m in modules(cfg, run, lora.rank) if m.target in lora.targets]
    expected = {leaf_location(p, cfg)[0] for m in mods for p in (m.a_path, m.b_path)}
    held = {key_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0] if is_adapter(key_names(p)[-1])}
    if held - expected:
        extra = "/".join(map(str, sorted(held - expected, key=str)[0]))
        raise CheckpointError(f"params hold adapter leaves run.lora.targets {lora.targets} does not cover "
                              f"(first: {extra})")
    hosts: dict[tuple, np.ndarray] = {}
    values: dict[nm.TensorSpec, np.ndarray] = {}
    for m in mods:
        for factor, path, shape in (("A", m.a_path, m.a_shape), ("B", m.b_path, m.b_shape)):
            loc, g = leaf_location(path, cfg)
            if loc not in hosts:
                if loc not in held:
                    raise CheckpointError(f"params have no adapter leaf {'/'.join(map(str, loc))} (run.lora.targets "
                                          f"{lora.targets} includes {m.target!r})")
                hosts[loc] = host_value(get_path(params, loc))  # every process gathers (a collective)
            x = hosts[loc] if g is None else hosts[loc][g]
            x = x if m.expert is None else x[m.expert]
            if tuple(x.shape) != shape:
                raise CheckpointError(f"adapter leaf {'/'.join(map(str, loc))} has shape {list(x.shape)}; rank "
                                      f"{lora.rank} needs {list(shape)} per layer")
            spec = factor_spec(m, factor, "BF16" if x.dtype == nm.np_dtype("BF16") else "F32")
            values[spec] = nm.leaf_to_hf(x, spec)
    conf = {"alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base or "", "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "layers_pattern": None,
            "layers_to_transform": None, "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer()
            else lora.alpha, "lora_dropout": 0.0, "modules_to_save": None, "peft_type": "LORA", "r": lora.rank,
            "rank_pattern": {}, "revision": None, "target_modules": sorted(m.name for m in mods),
            "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}
    side = {"format": 1, "lora": {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
                                  "dropout": lora.dropout}, "architecture": architecture(cfg)}
    out_dir = os.path.abspath(os.fspath(out_dir))
    failed = True
    try:
        if is_main():  # one process of a job writes the directory (every one holds the gathered values)
            with staged_dir(out_dir, overwrite=overwrite) as tmp:
                write_shard(os.path.join(tmp, ADAPTER_WEIGHTS), list(values), values)
                for fname, obj in ((ADAPTER_CONFIG, conf), (SIDECAR, side)):
                    with open(os.path.join(tmp, fname), "w", encoding="utf-8") as f:
                        json.dump(obj, f, indent=2, sort_keys=True)
        failed = False
    finally:
        if any_process(failed) and not failed:  # a collective: every process learns whether the write failed
            raise CheckpointError("process 0 failed to write the adapter", file=out_dir)
    return {"dir": out_dir, "modules": len(mods), "tensors": len(values)}


# ------------------------------------------------------------------------------------------------------- load

def _json(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            obj = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"not valid JSON ({e})", file=file) from None
    if not isinstance(obj, dict):
        raise CheckpointError("must be a JSON object", file=file)
    return obj


def read_config(path: str) -> tuple[int, float]:
    """(r, lora_alpha) of ``adapter_config.json``, every field k3jax would apply differently from PEFT refused."""
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise CheckpointError(f"no {ADAPTER_CONFIG}: not a PEFT adapter directory", file=path)
    c = _json(file)

    def need(ok: bool, fld: str, msg: str):
        if not ok:
            raise CheckpointError(f"field {fld!r}: {msg} (got {c.get(fld)!r})", file=file)

    for fld in REQUIRED:
        need(fld in c, fld, "missing")
    need(c["peft_type"] == "LORA", "peft_type", "only LORA adapters are supported")
    r, alpha = c["r"], c["lora_alpha"]
    need(type(r) is int and r > 0, "r", "must be a positive integer")
    need(type(alpha) in (int, float) and alpha > 0, "lora_alpha", "must be a positive number")
    need(not c.get("use_rslora", False), "use_rslora", "rank-stabilized scaling (alpha / sqrt(r)) is not supported; "
         "k3jax scales by lora_alpha / r")
    need(not c.get("fan_in_fan_out", False), "fan_in_fan_out", "only nn.Linear's [out, in] weights are supported")
    # lora_dropout is not checked: dropout acts only while training, so an adapter trained with it applies the same
    # way (k3jax's own training has none: LoRAConfig.dropout)
    need(c.get("bias", "none") == "none", "bias", "bias adapters are not supported; only 'none'")
    need(not c.get("use_dora", False), "use_dora", "DoRA is not supported")
    need(not c.get("modules_to_save"), "modules_to_save", "full module copies are not supported")
    for fld in ("rank_pattern", "alpha_pattern"):
        need(not c.get(fld), fld, "per-module ranks / alphas are not supported (one r and lora_alpha)")
    return r, float(alpha)


def _sidecar(path: str, cfg: K3Config) -> tuple[str, dict] | None:
    """(file, its "lora" dict) of ``k3jax_adapter.json`` once its architecture is checked against ``cfg``; None
    without a sidecar (an adapter PEFT wrote: the modules and shapes are then the only check)."""
    file = os.path.join(path, SIDECAR)
    if not os.path.exists(file):
        return None
    side = _json(file)
    arch, lora = side.get("architecture"), side.get("lora")
    if not isinstance(arch, dict) or not isinstance(lora, dict):
        raise CheckpointError("fields 'architecture' and 'lora' must be objects", file=file)
    try:
        other = K3Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in arch.items()})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"field 'architecture': not a k3jax architecture ({e})", file=file) from None
    diff = architecture_diff(other, cfg)
    if diff:
        raise CheckpointError(f"the adapter was made for another base: the architecture differs in {', '.join(diff)}",
                              file=file)
    return file, lora


def _factors(path: str) -> tuple[str, Checkpoint, dict[str, dict[str, object]]]:
    """(weights file, its reader, {module: {"A": entry, "B": entry}}) with every key checked."""
    path = os.path.abspath(path)          # the reader joins its directory with the file name it was given
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        pickles = [f for f in sorted(os.listdir(path)) if f.lower().endswith(PICKLE_SUFFIXES)]
        why = f"only pickle-based weights ({', '.join(pickles)}); k3jax never unpickles" if pickles else "missing"
        raise CheckpointError(f"no {ADAPTER_WEIGHTS}: {why}", file=path)
    h = read_header(file, file)
    found: dict[str, dict[str, object]] = {}
    for key, e in h.entries.items():
        m = KEY_RE.match(key)
        if not m:
            raise CheckpointError("not a LoRA factor (base_model.model.<module>.lora_A/lora_B.weight); k3jax reads "
                                  "plain LoRA adapters only", file=file, tensor=key)
        if m.group(2) in found.setdefault(m.group(1), {}):
            raise CheckpointError(f"a second lora_{m.group(2)} for module {m.group(1)!r}", file=file, tensor=key)
        found[m.group(1)][m.group(2)] = e
    return file, Checkpoint(path, {file: h}, dict(h.entries)), found


def load_adapter(path, cfg: K3Config, run_base: RunConfig) -> tuple[LoRAConfig, dict]:
    """A PEFT LoRA adapter directory for the base ``cfg`` → (its LoRAConfig, the adapter leaves as a nested dict).

    The leaves sit where ``abstract_params(cfg, run_base.replace(lora=lora))`` has them (the state's layout:
    stacked groups carry the leading layers axis) in its dtypes; merge them into the base params with
    ``k3jax.layers.experts.merge_trees`` and run with ``run_base.replace(lora=lora)``. Raises CheckpointError (an
    InputError) naming the file and the field, tensor or module for anything that does not fit (module doc)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError("not an adapter directory", file=path)
    r, alpha = read_config(path)
    side = _sidecar(path, cfg)
    file, ck, found = _factors(path)
    if not found:
        raise CheckpointError("holds no LoRA factors", file=file)
    mods = {m.name: m for m in modules(cfg, run_base, r)}
    alias = {m.alias: m.name for m in mods.values() if m.alias}
    spelled: dict[str, str] = {}  # module name -> the file's spelling of it, where that is the alias
    for name in list(found):
        if name in alias:
            if alias[name] in found:
                raise CheckpointError(f"module {alias[name]!r} is given twice (also as {name!r})", file=file)
            spelled[alias[name]] = name
            found[alias[name]] = found.pop(name)
    for name, fac in found.items():
        if name not in mods:
            raise CheckpointError(f"module {name!r} is not a module of this base that k3jax adapts", file=file,
                                  tensor=f"{PREFIX}{name}.lora_{next(iter(fac))}.weight")
        if len(fac) < 2:
            missing = ({"A", "B"} - set(fac)).pop()
            raise CheckpointError(f"module {spelled.get(name, name)!r} has no lora_{missing}", file=file)
    present = {mods[n].target for n in found}
    for m in mods.values():
        if m.target in present and m.name not in found:
            raise CheckpointError(f"target group {m.target!r} is only partly covered: module {m.name!r} has no "
                                  "factors (k3jax adapters are all-or-nothing per group)", file=file)
    lora = LoRAConfig(rank=r, alpha=alpha, targets=tuple(t for t in LORA_TARGETS if t in present))
    if side is not None:
        for fld, want in (("rank", lora.rank), ("alpha", lora.alpha), ("targets", sorted(lora.targets))):
            got = side[1].get(fld)
            got = sorted(got) if fld == "targets" and isinstance(got, list) else got
            if got != want:
                raise CheckpointError(f"field 'lora.{fld}' is {got!r}, but {ADAPTER_CONFIG} and the tensors give "
                                      f"{want!r}", file=side[0])
    abstract = abstract_params(cfg, run_base.replace(lora=lora))
    out: dict[tuple, np.ndarray] = {}
    try:
        for name, fac in found.items():
            m = mods[name]
            for factor, e in sorted(fac.items()):
                spec = factor_spec(m, factor, "F32")
                if tuple(e.shape) != spec.shape:
                    raise CheckpointError(f"shape {list(e.shape)}; the base's module and r = {r} need "
                                          f"{list(spec.shape)}", file=file, tensor=e.name)
                if e.dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"dtype {e.dtype}: LoRA factors must be floating point", file=file,
                                          tensor=e.name)
                loc, g = leaf_location(spec.path, cfg)
                if loc not in out:
                    s = get_path(abstract, loc)
                    out[loc] = np.zeros(s.shape, s.dtype)
                idx = (() if g is None else (g,)) + (() if m.expert is None else (m.expert,))
                out[loc][idx] = nm.leaf_from_hf(ck.read_entry(e), spec, m.a_shape if factor == "A" else m.b_shape)
    finally:
        ck.close()
    tree: dict = {}
    for loc, value in out.items():
        tree = set_path(tree, loc, jnp.asarray(value))
    return lora, tree


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "MODULE_RENAMES", "SIDECAR", "Module", "factor_spec", "load_adapter",
           "modules", "read_config", "save_adapter"]
