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
Routed experts come in two layouts (``experts_layout``; ``LoRAConfig.peft_experts``): per-expert modules with the
checkpoint's names (``block_sparse_moe.experts.{e}.w{1,2,3}``, the release's own modelling code), or fused —
transformers 5 holds them as 3-D parameters with no per-expert module, which PEFT reaches through
``target_parameters`` (k3jax/checkpoint/peft_experts.py). Loading recognises either (never both) and accepts
either spelling of a module (not both). With W's adapter A [*in, r], B [r, *out] (that layer's row of a stack,
that expert's slice of an expert stack):

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

Shared-A experts (``LoRAConfig.experts_shared_a``: one A [in, r] per routed stack, B per expert) have no PEFT form:
the export writes that A as every expert's lora_A (in either layout) and the sidecar records
``"experts_shared_a": true``; loading with that sidecar checks every expert's A equals expert 0's (else an error
naming the tensor) and returns the factorised leaves. Without the sidecar (an adapter PEFT wrote, or one whose
sidecar was removed) the same files load per expert.
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
from k3jax.checkpoint import peft_experts as px
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
    The routed experts' layout: ``experts_layout`` (module doc; peft_experts.py for the fused one). adapter_config's
    ``lora_dropout`` is ``run.lora.dropout``, but 0 with fused experts (PEFT refuses dropout on target_parameters:
    ``px.config_fields``); the sidecar keeps the trained value. Returns {"dir", "modules", "tensors", "experts"}."""
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
    fused = px.fused_params([m for m in mods if m.expert is not None], MODULE_RENAMES[nm.default_layout(cfg)]) \
        if experts_layout(lora, cfg) == "fused" else []
    per_expert: dict[tuple, np.ndarray] = {}  # (module, factor) -> leaf factor, for the fused tensors
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
            shared = factor == "A" and lora.experts_shared_a  # one A [in, r] for the stack: every expert's copy
            x = x if m.expert is None or shared else x[m.expert]
            if tuple(x.shape) != shape:
                raise CheckpointError(f"adapter leaf {'/'.join(map(str, loc))} has shape {list(x.shape)}; rank "
                                      f"{lora.rank} needs {list(shape)} per layer")
            if fused and m.expert is not None:
                per_expert[m, factor] = x
                continue
            spec = factor_spec(m, factor, "BF16" if x.dtype == nm.np_dtype("BF16") else "F32")
            values[spec] = nm.leaf_to_hf(x, spec)
    names = px.tensor_names(fused, PREFIX)
    for key, x in px.fused_tensors(fused, lambda m, f: per_expert[m, f], lora.rank).items():
        values[px.spec(names[key], x)] = x
    conf = {"alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base or "", "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "layers_pattern": None,
            "layers_to_transform": None, "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer()
            else lora.alpha, "lora_dropout": lora.dropout, "modules_to_save": None, "peft_type": "LORA", "r": lora.rank,
            "rank_pattern": {}, "revision": None, "target_modules": sorted(m.name for m in mods if not (
                fused and m.expert is not None)), "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}
    if fused:
        conf.update(px.config_fields(fused, lora.rank, conf["lora_alpha"]))
    side = {"format": 1, "lora": {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
                                  "dropout": lora.dropout}, "architecture": architecture(cfg)}
    if lora.experts_shared_a:  # absent otherwise: the sidecars written before it stay byte for byte
        side["lora"]["experts_shared_a"] = True
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
    return {"dir": out_dir, "modules": len(mods), "tensors": len(values), "experts": "fused" if fused else
            "per-expert"}


def experts_layout(lora: LoRAConfig, cfg: K3Config) -> str:
    """"per-expert" or "fused": the routed experts' layout a PEFT export writes (``LoRAConfig.peft_experts``;
    "auto": fused on the Kimi-Linear layout, whose transformers 5 model has only the fused 3-D parameters)."""
    if lora.peft_experts != "auto":
        return lora.peft_experts
    return "fused" if nm.default_layout(cfg) == "kimi-linear" else "per-expert"


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


class AdapterConfig(NamedTuple):
    """``adapter_config.json`` once checked: its file, r, lora_alpha, and the whole object."""

    file: str
    r: int
    alpha: float
    raw: dict


def read_config(path: str) -> AdapterConfig:
    """``adapter_config.json`` with every field k3jax would apply differently from PEFT refused (rank / alpha
    patterns and ``target_parameters`` are checked against the base by ``peft_experts``)."""
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
    drop = c.get("lora_dropout", 0.0)  # acts only while training: any value applies the same way at inference
    need(type(drop) in (int, float) and 0 <= drop < 1, "lora_dropout", "must be a probability in [0, 1)")
    need(c.get("bias", "none") == "none", "bias", "bias adapters are not supported; only 'none'")
    need(not c.get("use_dora", False), "use_dora", "DoRA is not supported")
    need(not c.get("modules_to_save"), "modules_to_save", "full module copies are not supported")
    for fld in ("rank_pattern", "alpha_pattern"):  # with target_parameters: peft_experts.check_patterns
        need(not c.get(fld) or c.get("target_parameters"), fld, "per-module ranks / alphas are not supported (one r "
             "and lora_alpha)")
    return AdapterConfig(file, r, float(alpha), c)


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
    conf = read_config(path)
    r, alpha = conf.r, conf.alpha
    side = _sidecar(path, cfg)
    file, ck, found = _factors(path)
    if not found:
        raise CheckpointError("holds no LoRA factors", file=file)
    mods = {m.name: m for m in modules(cfg, run_base, r)}
    experts = [m for m in mods.values() if m.expert is not None]
    try:
        fused = px.read_fused(conf.raw, conf.file, file, found, px.fused_params(
            experts, MODULE_RENAMES[nm.default_layout(cfg)]), [n for n in found if n not in mods or
                                                               mods[n].expert is None], r, alpha, ck.read_entry,
            PREFIX)
    except BaseException:
        ck.close()
        raise
    if fused:
        clash = next((n for n in found if n in mods and mods[n].expert is not None), None)
        if clash:
            raise CheckpointError("the routed experts are given twice: as target_parameters (fused) and as "
                                  f"per-expert module {clash!r}", file=file,
                                  tensor=next(iter(found[clash].values())).name)
        gap = next((m for m in experts if (m, "A") not in fused), None)
        if gap is not None:
            raise CheckpointError("target group 'experts' is only partly covered: target_parameters leaves out "
                                  f"the fused parameter holding {gap.name!r} (k3jax adapts gate_up_proj and "
                                  "down_proj of every MoE layer)", file=conf.file)
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
    present = {mods[n].target for n in found} | ({"experts"} if fused else set())
    for m in mods.values():
        if m.target in present and m.name not in found and not (fused and m.expert is not None):
            raise CheckpointError(f"target group {m.target!r} is only partly covered: module {m.name!r} has no "
                                  "factors (k3jax adapters are all-or-nothing per group)", file=file)
    lora = LoRAConfig(rank=r, alpha=alpha, targets=tuple(t for t in LORA_TARGETS if t in present),
                      dropout=float(conf.raw.get("lora_dropout", 0.0)),
                      peft_experts="fused" if fused else "per-expert" if "experts" in present else "auto")
    shared_a = False
    if side is not None:
        for fld, want in (("rank", lora.rank), ("alpha", lora.alpha), ("targets", sorted(lora.targets))):
            got = side[1].get(fld)
            got = sorted(got) if fld == "targets" and isinstance(got, list) else got
            if got != want:
                raise CheckpointError(f"field 'lora.{fld}' is {got!r}, but {ADAPTER_CONFIG} and the tensors give "
                                      f"{want!r}", file=side[0])
        shared_a = side[1].get("experts_shared_a", False)
        if not isinstance(shared_a, bool) or (shared_a and "experts" not in lora.targets):
            raise CheckpointError(f"field 'lora.experts_shared_a' is {shared_a!r}: true or false, and true only with "
                                  "routed-expert factors", file=side[0])
        drop = side[1].get("dropout", lora.dropout)   # the trained value (a fused adapter's config says 0)
        if type(drop) not in (int, float) or not 0 <= drop < 1:
            raise CheckpointError(f"field 'lora.dropout' is {drop!r}: must be a probability in [0, 1)", file=side[0])
        lora = lora.replace(dropout=float(drop))
    abstract = abstract_params(cfg, run_base.replace(lora=lora))
    out: dict[tuple, np.ndarray] = {}
    a_names: dict[tuple, str] = {}  # (leaf, layer, expert) -> the tensor a routed expert's A came from

    def put(m: Module, path: tuple, x: np.ndarray, tensor: str) -> None:  # one layer's (expert's) factor into its leaf
        loc, g = leaf_location(path, cfg)
        if loc not in out:
            s = get_path(abstract, loc)
            out[loc] = np.zeros(s.shape, s.dtype)
        out[loc][(() if g is None else (g,)) + (() if m.expert is None else (m.expert,))] = x
        if m.expert is not None and path == m.a_path:
            a_names[loc, g, m.expert] = tensor
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
                put(m, spec.path, nm.leaf_from_hf(ck.read_entry(e), spec, m.a_shape if factor == "A" else
                                                  m.b_shape), e.name)
        fused_a = px.a_tensor_names(px.fused_params(experts, MODULE_RENAMES[nm.default_layout(cfg)]), PREFIX) \
            if fused else {}
        for (m, factor), x in fused.items():
            put(m, m.a_path if factor == "A" else m.b_path, x, fused_a.get(m.name, ""))
    finally:
        ck.close()
    if shared_a:
        lora = lora.replace(experts_shared_a=True)
        _share_a(out, a_names, file)
    tree: dict = {}
    for loc, value in out.items():
        tree = set_path(tree, loc, jnp.asarray(value))
    return lora, tree


def _share_a(out: dict, a_names: dict, file: str) -> None:
    """The routed stacks' per-expert A leaves of ``out`` ([..., E, in, r]) → their one shared A [..., in, r]
    (``LoRAConfig.experts_shared_a``, recorded by the sidecar), once every expert's copy is checked equal to expert
    0's; a copy that differs is refused, naming its tensor."""
    for loc in {loc for loc, _, _ in a_names}:
        x = out[loc]
        axis = x.ndim - 3  # the expert axis of [*layers, E, in, r]
        same = np.all(x == np.take(x, [0], axis=axis), axis=(-2, -1))  # [*layers, E]
        if not np.all(same):
            bad = tuple(int(i) for i in np.argwhere(~same)[0])
            g, e = (None, bad[0]) if axis == 0 else bad
            raise CheckpointError(f"k3jax's sidecar ({SIDECAR}) says the routed experts share one lora_A "
                                  f"(experts_shared_a), but expert {e}'s differs from expert 0's", file=file,
                                  tensor=a_names.get((loc, g, e)))
        out[loc] = np.take(x, 0, axis=axis)


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "MODULE_RENAMES", "SIDECAR", "AdapterConfig", "Module",
           "experts_layout", "factor_spec", "load_adapter", "modules", "read_config", "save_adapter"]
