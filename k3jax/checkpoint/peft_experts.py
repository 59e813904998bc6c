"""Routed-expert LoRA in transformers 5's fused layout: PEFT ``target_parameters`` over 3-D expert parameters.

transformers 5 (KimiLinear; K3 follows it) holds each MoE layer's routed experts as two parameters of one module,
in this declaration order: ``<experts>.gate_up_proj`` [E, 2F, D] (w1 — the gate, the activation's input — then w3)
and ``<experts>.down_proj`` [E, D, F] (w2), with ``<experts>`` = ``model.layers.{l}.mlp.experts`` (the per-expert
module name less ``.{e}.w*``, with the layout's ``MODULE_RENAMES``). PEFT (``LoraConfig(target_parameters=[...])``,
``lora.ParamWrapper``; 0.21) gives a parameter [E, out, in] of rank r the factors

    lora_A.weight [r·E, in]    row e·r + k        = A_e[k, :]
    lora_B.weight [out, r·E]   column k·E + e     = B_e[:, k]       (rank-major, expert-minor: not A's order)
    delta_e [out, in] = (lora_alpha / r) · B_e A_e

and names them after the module it wraps: the first targeted parameter of a module is wrapped first, and a second
one wraps that wrapper, so the LAST targeted parameter (in declaration order) is ``<experts>.lora_A.weight`` and
the one before it ``<experts>.base_layer.lora_A.weight``.

k3jax's separate w1 / w3 adapters (A [D, r], B [r, F] each) become one rank-2r ``gate_up_proj`` adapter:
A_e = [A1ᵀ; A3ᵀ] [2r, D] and block-diagonal B_e = [[B1ᵀ, 0], [0, B3ᵀ]] [2F, 2r], with ``rank_pattern`` 2r and
``alpha_pattern`` 2·alpha so the scale stays alpha / r; ``down_proj`` is rank r (A2ᵀ, B2ᵀ). Loading also takes
PEFT's plain rank-r ``gate_up_proj`` adapter (one A for gate and up: k3jax's A1 = A3) and a rank-2r one whose B
is block-diagonal (off-diagonal blocks exactly 0); anything else (another rank or scale on a fused parameter, a
full rank-2r B, a pattern on another module) is refused naming the file and the field or tensor.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.errors import CheckpointError

GATE_UP, DOWN = "gate_up_proj", "down_proj"
PARAMS = (GATE_UP, DOWN)  # transformers' declaration order in the experts module: the order PEFT wraps them in
STACKS = {GATE_UP: ("w1", "w3"), DOWN: ("w2",)}  # k3jax's stacks inside each fused parameter, in its row order
_EXPERT_MODULE = re.compile(r"^(.*)\.(\d+)\.(w[123])$")


class FusedParam(NamedTuple):
    """One fused expert parameter of one MoE layer: ``experts`` its module (transformers' name), ``param``
    ``gate_up_proj`` / ``down_proj``, ``parts`` {stack: [per-expert ``peft.Module``, by expert id]}."""

    experts: str
    param: str
    parts: dict

    @property
    def key(self) -> str:  # what a target_parameters entry is matched against (PEFT: equal, or a "."-suffix)
        return f"{self.experts}.{self.param}"

    @property
    def num_experts(self) -> int:
        return len(next(iter(self.parts.values())))


def fused_params(mods, renames) -> list[FusedParam]:
    """The fused parameters covering the per-expert ``mods`` (``peft.Module`` with an expert id), by layer, in
    ``PARAMS`` order within a layer; ``renames``: the layout's ``MODULE_RENAMES``."""
    by: dict[tuple[str, str], dict[str, dict[int, object]]] = {}
    for m in mods:
        head, e, stack = _EXPERT_MODULE.match(m.name).groups()
        for old, new in renames:
            head = head.replace(old, new)
        param = GATE_UP if stack in STACKS[GATE_UP] else DOWN
        by.setdefault((head, param), {}).setdefault(stack, {})[int(e)] = m
    layer = {head: i for i, (head, _) in enumerate(by)}  # first appearance: the name map's layer order
    out = [FusedParam(head, param, {s: [parts[s][e] for e in sorted(parts[s])] for s in STACKS[param]})
           for (head, param), parts in by.items()]
    return sorted(out, key=lambda f: (layer[f.experts], PARAMS.index(f.param)))


def suffix(f: FusedParam) -> str:
    """``model.layers.3.mlp.experts.gate_up_proj`` → ``mlp.experts.gate_up_proj``: the target_parameters entry."""
    return re.sub(r"^.*?layers\.\d+\.", "", f.key)


def tensor_names(fused: list[FusedParam], prefix: str) -> dict[tuple[str, str], str]:
    """{(fused key, "A" | "B"): PEFT's tensor name}: the last targeted parameter of a module is the outer wrapper."""
    by_module: dict[str, list[FusedParam]] = {}
    for f in fused:
        by_module.setdefault(f.experts, []).append(f)
    out = {}
    for experts, fs in by_module.items():
        fs = sorted(fs, key=lambda f: PARAMS.index(f.param))
        for depth, f in enumerate(reversed(fs)):
            for factor in "AB":
                out[f.key, factor] = f"{prefix}{experts}{'.base_layer' * depth}.lora_{factor}.weight"
    return out


# ------------------------------------------------------------------------------------------------------- save

def fused_tensors(fused: list[FusedParam], factor: Callable, rank: int) -> dict[tuple[str, str], np.ndarray]:
    """{(fused key, "A" | "B"): array} in PEFT's layout; ``factor(module, "A" | "B")`` → that expert's leaf factor
    (A [in, r], B [r, out], numpy). ``gate_up_proj`` is rank 2r (block-diagonal B), ``down_proj`` rank r."""
    out = {}
    for f in fused:
        stacks = STACKS[f.param]
        E, k = f.num_experts, len(stacks)
        a0, b0 = factor(f.parts[stacks[0]][0], "A"), factor(f.parts[stacks[0]][0], "B")
        n_in, n_out = a0.shape[0], b0.shape[1]
        a = np.zeros((E, k * rank, n_in), a0.dtype)               # [E, k·r, in] → [k·r·E, in]
        b = np.zeros((k * n_out, k * rank, E), b0.dtype)          # [out, k·r, E] → [out, k·r·E]
        for j, s in enumerate(stacks):
            for e, m in enumerate(f.parts[s]):
                a[e, j * rank:(j + 1) * rank] = factor(m, "A").T
                b[j * n_out:(j + 1) * n_out, j * rank:(j + 1) * rank, e] = factor(m, "B").T
        out[f.key, "A"] = a.reshape(E * k * rank, n_in)
        out[f.key, "B"] = b.reshape(k * n_out, k * rank * E)
    return out


def a_tensor_names(fused: list[FusedParam], prefix: str) -> dict[str, str]:
    """{per-expert module name: the fused lora_A tensor holding its A}."""
    names = tensor_names(fused, prefix)
    return {m.name: names[f.key, "A"] for f in fused for ms in f.parts.values() for m in ms}


def config_fields(fused: list[FusedParam], rank: int, alpha) -> dict:
    """adapter_config.json's target_parameters and the gate_up_proj rank / alpha patterns (PEFT's spelling), and
    ``lora_dropout`` 0 whatever the run trained with: PEFT's ``ParamWrapper`` (the target_parameters layer) refuses
    any other value, and dropout acts only while training, so the adapter's inference math is the same; k3jax's
    sidecar keeps the trained value (peft.py)."""
    names = list(dict.fromkeys(suffix(f) for f in fused))
    gate_up = [n for n in names if n.endswith(f".{GATE_UP}") or n == GATE_UP]
    return {"target_parameters": names, "rank_pattern": {n: 2 * rank for n in gate_up},
            "alpha_pattern": {n: 2 * alpha for n in gate_up}, "lora_dropout": 0.0}


# ------------------------------------------------------------------------------------------------------- load

def pattern_key(keys, target: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first pattern that matches ``target`` as a "."-suffix regex, else None."""
    return next((k for k in keys if re.match(rf"(.*\.)?({k})$", target)), None)


def match_targets(entries, fused: list[FusedParam], file: str) -> list[FusedParam]:
    """The fused parameters target_parameters ``entries`` select (PEFT: the key itself or a "."-suffix of it);
    an entry that selects none of them is refused."""
    if not isinstance(entries, list) or not all(isinstance(t, str) for t in entries):
        raise CheckpointError(f"field 'target_parameters': must be a list of names (got {entries!r})", file=file)
    chosen = set()
    for t in entries:
        hit = [f.key for f in fused if f.key == t or f.key.endswith(f".{t}")]
        if not hit:
            raise CheckpointError(f"field 'target_parameters': {t!r} is no routed-expert parameter of this base "
                                  f"(k3jax adapts {', '.join(sorted({suffix(f) for f in fused})) or 'none'} through "
                                  "target_parameters)", file=file)
        chosen.update(hit)
    return [f for f in fused if f.key in chosen]


def check_patterns(conf: dict, file: str, targets: list[str], fused: list[FusedParam], r: int,
                   alpha: float) -> dict[str, int]:
    """{gate_up key: its rank} after checking ``rank_pattern`` / ``alpha_pattern``: each pattern may only touch
    gate_up_proj parameters, whose rank must be r or 2r at k3jax's one scale alpha / r. ``targets``: every other
    adapted module name of the file."""
    pats = {fld: conf.get(fld) or {} for fld in ("rank_pattern", "alpha_pattern")}
    for fld, p in pats.items():
        if not isinstance(p, dict):
            raise CheckpointError(f"field {fld!r}: must be an object (got {p!r})", file=file)
        for key, v in p.items():
            hits = [t for t in targets if re.match(rf"(.*\.)?({key})$", t)]
            hits_f = [f for f in fused if re.match(rf"(.*\.)?({key})$", f.key)]
            if hits or not hits_f or any(f.param != GATE_UP for f in hits_f):
                where = hits[0] if hits else next((f.key for f in hits_f if f.param != GATE_UP), None)
                raise CheckpointError(f"field {fld!r}: key {key!r} " + (f"applies to {where!r}; " if where else
                                      "matches no adapted gate_up_proj; ") + "k3jax has one r and lora_alpha, "
                                      "besides a gate_up_proj of rank 2r (its w1 and w3 adapters side by side)",
                                      file=file)
            if type(v) not in (int, float) or v <= 0 or (fld == "rank_pattern" and type(v) is not int):
                raise CheckpointError(f"field {fld!r}: {key!r} must be a positive number (got {v!r})", file=file)
    ranks = {}
    for f in fused:
        if f.param != GATE_UP:
            continue
        rk, ak = (pattern_key(pats[fld], f.key) for fld in ("rank_pattern", "alpha_pattern"))
        rg, ag = pats["rank_pattern"].get(rk, r), pats["alpha_pattern"].get(ak, alpha)
        if rg not in (r, 2 * r) or ag * r != alpha * rg:
            raise CheckpointError(f"field 'rank_pattern' / 'alpha_pattern': {f.key} has rank {rg}, lora_alpha {ag}; "
                                  f"k3jax reads a gate_up_proj of rank {r} or {2 * r} at the scale lora_alpha / r "
                                  f"= {alpha / r:g}", file=file)
        ranks[f.key] = rg
    return ranks


def split_fused(f: FusedParam, a: np.ndarray, b: np.ndarray, rank_g: int, r: int, names: tuple[str, str],
                file: str) -> dict:
    """PEFT's fused factors (float arrays, shapes checked here) → {(per-expert module, "A" | "B"): leaf factor}."""
    stacks = STACKS[f.param]
    E, k = f.num_experts, len(stacks)
    m0 = f.parts[stacks[0]][0]
    n_in, n_out = m0.a_shape[0], m0.b_shape[1]
    for x, want, name in ((a, (rank_g * E, n_in), names[0]), (b, (k * n_out, rank_g * E), names[1])):
        if tuple(x.shape) != want:
            raise CheckpointError(f"shape {list(x.shape)}; {f.key} [{E}, {k * n_out}, {n_in}] with rank {rank_g} "
                                  f"needs {list(want)}", file=file, tensor=name)
    a = a.reshape(E, rank_g, n_in)
    b = b.reshape(k * n_out, rank_g, E)
    out = {}
    for j, s in enumerate(stacks):
        rows = slice(j * n_out, (j + 1) * n_out)
        cols = slice(j * r, (j + 1) * r) if rank_g == k * r and k > 1 else slice(0, r)
        if rank_g == k * r and k > 1:
            off = np.delete(b[rows], np.arange(cols.start, cols.stop), axis=1)
            if np.any(off != 0):
                raise CheckpointError(f"{f.key} has rank {rank_g} = 2r but its lora_B is not block-diagonal "
                                      f"(the {s} rows hold nonzeros outside their r columns): k3jax's w1 and w3 "
                                      f"adapters have rank {r} each", file=file, tensor=names[1])
        for e, m in enumerate(f.parts[s]):
            out[m, "A"] = a[e, cols].T
            out[m, "B"] = b[rows, cols, e].T
    return out


def read_fused(conf: dict, conf_file: str, file: str, found: dict, fused_all: list[FusedParam], others: list[str],
               r: int, alpha: float, read: Callable, prefix: str) -> dict:
    """{(per-expert module, "A" | "B"): leaf factor} of a file's ``target_parameters`` adapters. ``found``: the
    file's {module: {"A": entry, "B": entry}} (its fused modules are popped from it); ``others``: the module names
    it adapts besides them; ``read(entry)`` → numpy. Empty without target_parameters."""
    entries = conf.get("target_parameters")
    names = tensor_names(fused_all, prefix)
    fused_modules = {n[len(prefix):].rsplit(".lora_", 1)[0] for n in names.values()}
    held = {m: found.pop(m) for m in list(found) if m in fused_modules}
    if not entries:
        if held:
            m, fac = next(iter(held.items()))
            raise CheckpointError(f"module {m!r} holds fused expert factors, but field 'target_parameters' of "
                                  f"{os.path.basename(conf_file)} names no parameter", file=file,
                                  tensor=next(iter(fac.values())).name)
        return {}
    fused = match_targets(entries, fused_all, conf_file)
    ranks = check_patterns(conf, conf_file, others, fused, r, alpha)
    want = tensor_names(fused, prefix)
    by_name = {e.name: e for fac in held.values() for e in fac.values()}
    for name in by_name:
        if name not in want.values():
            raise CheckpointError("not a factor of the fused parameters target_parameters names (PEFT nests a "
                                  "module's wrappers: the last of gate_up_proj, down_proj is <experts>.lora_*, the "
                                  "one before it <experts>.base_layer.lora_*)", file=file, tensor=name)
    out = {}
    for f in fused:
        pair = want[f.key, "A"], want[f.key, "B"]
        for name in pair:
            if name not in by_name:
                raise CheckpointError(f"{f.key} is in target_parameters but has no tensor {name!r}", file=file)
            if by_name[name].dtype not in ("F64", "F32", "F16", "BF16"):
                raise CheckpointError(f"dtype {by_name[name].dtype}: LoRA factors must be floating point", file=file,
                                      tensor=name)
        a, b = (np.asarray(read(by_name[n]), np.float64) for n in pair)
        out.update(split_fused(f, a, b, ranks.get(f.key, r), r, pair, file))
    return out


def spec(name: str, x: np.ndarray) -> nm.TensorSpec:
    """A write_shard spec for one fused factor (BF16 where the leaf is, else F32)."""
    dtype = "BF16" if x.dtype == nm.np_dtype("BF16") else "F32"
    return nm.TensorSpec(name, dtype, tuple(x.shape), (), "copy", None, 1)


__all__ = ["DOWN", "GATE_UP", "PARAMS", "STACKS", "FusedParam", "a_tensor_names", "check_patterns", "config_fields",
           "fused_params", "fused_tensors", "match_targets", "pattern_key", "read_fused", "spec", "split_fused",
           "suffix", "tensor_names"]
