"""Ablation files for `k3 ablate`: parse, resolve every arm to its full configuration, enforce the one-factor
guarantee — all before any compute. Bad input raises ``AblationSpecError`` (a ValueError: exit 2) naming the
file, table and key.

    spec = load_spec("experiments/ablations/attn_res.toml")
    spec.arms["attn_res=plain"].flat["model.attn_res_block_size"]     # None
    spec.arms["attn_res=plain"].derived["params"]                     # fewer than the base's

Schema (every table is strict: an unknown key is an error that names it):

    name = "attn_res"                        # optional; default: the file's stem
    description = "AttnRes vs plain residual"
    seeds = 5                                # n -> seeds 0..n-1, or a list of distinct non-negative integers
    [base]
    preset = "k3-mini"                       # or config = "path/config.json" (relative to this file); one of them
    model = { kda_conv_size = 4 }            # optional K3Config overrides; the string "none" means null
    train = { batch = 8, seq_len = 128 }     # optional training settings: TRAIN_KEYS (devices defaults to 1)
    [budget]
    tokens = 131072                          # training tokens per run = steps x batch x seq_len; or steps = N
    [data]                                   # optional; k3 train's defaults
    files = []                               # text / JSONL files relative to this file (default: the stdlib corpus)
    max_bytes = 4194304
    heldout_frac = 0.05
    [eval]                                   # optional
    windows = 64                             # held-out windows, the same ones for every arm and seed
    every = 16                               # eval interval in steps (the curves; default steps // 8)
    bootstrap = 2000                         # bootstrap resamples of the windows
    [aa]                                     # optional: the noise floor
    seed_offset = 1000                       # an A/A arm: the base at seeds s + 1000, paired with the base at s
    repeat = true                            # the base at the first seed run twice: must be bit-identical
    [output]                                 # optional; neither changes a result
    ckpt_every = 25
    keep_checkpoints = true                  # false: delete a run's orbax directory once its result is recorded
    [[factor]]
    name = "attn_res"                        # a built-in factor (FACTORS) supplies the rest; a new name needs them
    keys = ["model.attn_res_block_size"]     # the settings ("model.*" / "train.*") its levels may change
    varies = ["params", "active_params"]     # derived values its levels may change
    holds = []                               # numeric derived values its levels keep within `tolerance` (relative)
    tolerance = 0.01
    [factor.levels]                          # in order; exactly one level resolves to the base
    attn_res = {}
    plain = { model = { attn_res_block_size = "none" } }

A scaling study replaces [budget] with [scaling] (budgets at >= 4 compute levels, the fit) and may give a factor
``tune = { lr = [...] }`` (each level picks its best value per budget) or add the ``calibration`` factor (``k``):
``k3jax.train.ablate_scaling`` has that schema.

Derived values (DERIVED): params and active_params (``k3 plan``'s counts), tokens (steps x batch x seq_len),
data_order (sha256 of every training batch at the first seed) and eval_windows (sha256 of the held-out windows).
An arm may differ from the base only in its factor's ``keys`` (and the settings they imply, IMPLIED) and in the
derived values its factor ``varies``; every other derived value must be equal, and those it ``holds`` within
``tolerance``. Arms that resolve to the same configuration run once (``Arm.run_id``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from k3jax.config import ConfigError, K3Config, RunConfig, from_hf, get_preset, k3_full_attn_layers
from k3jax.errors import InputError

DERIVED = ("params", "active_params", "tokens", "data_order", "eval_windows")
NUMERIC_DERIVED = ("params", "active_params", "tokens")
TRAIN_KEYS = ("batch", "micro_batches", "seq_len", "lr", "optimizer", "qat", "compute_dtype", "balance", "sign_gamma",
              "qb_ema", "aux_alpha", "qk_clip", "qk_tau", "devices", "opt_state_dtype", "muon_layout")
# Training keys added after ablation files and their recorded directories existed: an arm's resolved settings hold
# one only when it differs from TrainConfig's default, so earlier files keep their fingerprints.
LATER_TRAIN_KEYS = ("opt_state_dtype", "muon_layout")
# Settings that follow from a declared key: the RunConfig mirrors of two training settings, the step count that a
# token budget gives for another batch shape.
IMPLIED = {"train.qat": ("run.qat",), "train.compute_dtype": ("run.compute_dtype",),
           "train.batch": ("train.steps",), "train.seq_len": ("train.steps",)}
_MODEL_FIELDS = {f.name: f for f in dataclasses.fields(K3Config) if f.name not in ("name", "extra")}


class AblationSpecError(InputError):
    """A malformed ablation file, or one whose arms break the one-factor guarantee; the message names the key."""


def _matched_standard_ffn(cfg: K3Config) -> int:
    """The expert width F' at which a standard MoE layer has the active parameters of ``cfg``'s LatentMoE layer:
    3dSF + 2dl (+ l norm) + 3lFk = 3d(S + k)F' (shared experts, latent projections, top-k routed experts)."""
    d, S, k, F = cfg.hidden_size, cfg.num_shared_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
    lat = cfg.moe_width
    latent = 3 * d * S * F + 2 * d * lat + (lat if cfg.latent_moe_use_norm else 0) + 3 * lat * F * k
    return max(1, round(latent / (3 * d * (S + k))))


# The built-in ablation factors (name -> the defaults of its table; levels may depend on the base config).
FACTORS: dict[str, dict[str, Any]] = {
    "attn_res": dict(keys=["model.attn_res_block_size"], varies=["params", "active_params"],
                     levels={"attn_res": {}, "plain": {"model": {"attn_res_block_size": "none"}}}),
    "glu": dict(keys=["model.hidden_act"],
                levels={"situ": {"model": {"hidden_act": "situ"}}, "swiglu": {"model": {"hidden_act": "silu"}}}),
    "latent_moe": dict(keys=["model.routed_expert_hidden_size", "model.latent_moe_use_norm",
                             "model.moe_intermediate_size"], varies=["params"], holds=["active_params"],
                       levels=lambda c: {"latent": {}, "standard": {"model": {
                           "routed_expert_hidden_size": "none", "latent_moe_use_norm": False,
                           "moe_intermediate_size": _matched_standard_ffn(c)}}}),
    "balance": dict(keys=["train.balance"], levels={b: {"train": {"balance": b}} for b in ("qb", "sign", "aux")}),
    "optimizer": dict(keys=["train.optimizer"],
                      levels={o: {"train": {"optimizer": o}} for o in ("per_head", "full", "adamw")}),
    "kda_mla": dict(keys=["model.full_attn_layers"], varies=["params", "active_params"],
                    levels=lambda c: {"ratio_3_1": {"model": {
                                          "full_attn_layers": list(k3_full_attn_layers(c.num_layers))}},
                                      "all_mla": {"model": {"full_attn_layers": list(range(1, c.num_layers + 1))}},
                                      "all_kda": {"model": {"full_attn_layers": []}}}),
    "qat": dict(keys=["train.qat"], levels={"off": {"train": {"qat": "off"}}, "weights": {"train": {"qat": "weights"}},
                                            "weights_acts": {"train": {"qat": "weights+acts"}}}),
    "kda_gate": dict(keys=["model.kda_gate_lower_bound"],
                     levels={"safe": {"model": {"kda_gate_lower_bound": -5.0}},
                             "softplus": {"model": {"kda_gate_lower_bound": "none"}}}),
}


@dataclass(frozen=True)
class Arm:
    """One resolved arm: its architecture, training settings (TrainConfig keywords except seed and output paths),
    run settings, the flat record of all of them (``model.*``, ``run.*``, ``train.*``) and the derived values."""

    name: str  # "base" or "factor=level"
    factor: str | None
    level: str | None
    cfg: K3Config
    train: dict
    run: RunConfig
    flat: dict
    derived: dict
    run_id: str = ""  # the name of the first arm with this exact configuration: they run once, under this name


@dataclass(frozen=True)
class Factor:
    name: str
    keys: tuple[str, ...]
    varies: tuple[str, ...]
    holds: tuple[str, ...]
    tolerance: float
    levels: dict  # level -> arm name (the base level -> "base", or its own arm when tuning moved it off the base)
    base_level: str
    tune: dict = field(default_factory=dict)  # tuned training setting -> candidates (a scaling study's factors)


@dataclass(frozen=True)
class Spec:
    path: str
    name: str
    description: str
    seeds: tuple[int, ...]
    base: Arm
    factors: tuple[Factor, ...]
    arms: dict  # arm name -> Arm, base first, then the factors' levels in order
    runs: dict  # run id -> Arm: the distinct configurations
    aa: dict  # {"seed_offset": int | None, "repeat": bool}
    bootstrap: int
    output: dict = field(default_factory=dict)  # {"ckpt_every", "keep_checkpoints"}
    fingerprint: str = ""

    @property
    def aa_seeds(self) -> tuple[int, ...]:
        off = self.aa.get("seed_offset")
        return tuple(s + off for s in self.seeds) if off else ()


# ---------------------------------------------------------------------------------------------------- parsing

def _err(where: str, msg: str) -> AblationSpecError:
    return AblationSpecError(f"{where}: {msg}")


def _strict(table, allowed, where: str) -> dict:
    if not isinstance(table, dict):
        raise _err(where, f"must be a table, got {type(table).__name__}")
    for k in table:
        if k not in allowed:
            near = difflib.get_close_matches(k, list(allowed), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; known keys: {', '.join(sorted(allowed))}"
            raise _err(where, f"unknown key {k!r}{hint}")
    return table


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pos_int(v, where: str) -> int:
    if not _is_int(v) or v < 1:
        raise _err(where, f"must be a positive integer, got {v!r}")
    return v


def _coerce(where: str, value, ftype: str, default):
    """A TOML value as a field of type ``ftype`` (dataclass annotation text): "none" -> None for optional fields,
    lists -> tuples, ints -> floats for float fields; anything else of the wrong type is an error."""
    if value == "none" and "None" in ftype:
        return None
    if "tuple" in ftype:
        if not isinstance(value, list) or not all(_is_int(i) for i in value):
            raise _err(where, f"must be a list of integers, got {value!r}")
        return tuple(value)
    if isinstance(default, bool) or ftype == "bool":
        if not isinstance(value, bool):
            raise _err(where, f"must be true or false, got {value!r}")
        return value
    if "float" in ftype:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _err(where, f"must be a number{' or \"none\"' if 'None' in ftype else ''}, got {value!r}")
        return float(value)
    if "int" in ftype:
        if not _is_int(value):
            raise _err(where, f"must be an integer{' or \"none\"' if 'None' in ftype else ''}, got {value!r}")
        return value
    if not isinstance(value, str):
        raise _err(where, f"must be a string, got {value!r}")
    return value


def _model_overrides(table, where: str) -> dict:
    _strict(table, _MODEL_FIELDS, where)
    return {k: _coerce(f"{where}.{k}", v, _MODEL_FIELDS[k].type, _MODEL_FIELDS[k].default) for k, v in table.items()}


def _train_overrides(table, where: str) -> dict:
    from k3jax.train.settings import TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    set_elsewhere = {"steps": "[budget]", "total_steps": "[budget]", "seed": "`seeds`", "data": "[data]",
                     "max_bytes": "[data]", "heldout_frac": "[data]", "eval_every": "[eval]",
                     "eval_windows": "[eval]", "ckpt_every": "[output]"}
    for k in table if isinstance(table, dict) else ():
        if k in set_elsewhere:
            raise _err(f"{where}.{k}", f"set by {set_elsewhere[k]} for every arm, not per level")
    _strict(table, TRAIN_KEYS, where)
    return {k: _coerce(f"{where}.{k}", v, fields[k].type, fields[k].default) for k, v in table.items()}


def parse_level(table, where: str) -> tuple[dict, dict]:
    _strict(table, ("model", "train"), where)
    return _model_overrides(table.get("model", {}), f"{where}.model"), _train_overrides(table.get("train", {}),
                                                                                       f"{where}.train")


def is_name(x) -> bool:
    """Factor and level names become directory names: letters, digits and '_' only."""
    return isinstance(x, str) and x != "" and x.isascii() and x.replace("_", "").isalnum()


def _seeds(v, where: str) -> tuple[int, ...]:
    if _is_int(v):
        return tuple(range(_pos_int(v, where)))
    if not isinstance(v, list) or not v or not all(_is_int(s) and s >= 0 for s in v):
        raise _err(where, f"must be a positive integer (a count) or a non-empty list of non-negative integers, "
                          f"got {v!r}")
    if len(set(v)) != len(v):
        raise _err(where, f"repeats a seed: {v}")
    return tuple(v)


def _declared(keys, where: str) -> tuple[str, ...]:
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise _err(where, f"must be a non-empty list of \"model.<field>\" / \"train.<setting>\" names, got {keys!r}")
    for k in keys:
        sect, _, name = k.partition(".")
        known = _MODEL_FIELDS if sect == "model" else TRAIN_KEYS if sect == "train" else None
        if known is None or name not in known:
            near = difflib.get_close_matches(k, [f"model.{f}" for f in _MODEL_FIELDS] + [f"train.{t}" for t in
                                                                                          TRAIN_KEYS], n=1)
            raise _err(where, f"unknown key {k!r}" + (f" (did you mean {near[0]!r}?)" if near else
                                                        " (keys are model.<K3Config field> or train.<setting>)"))
    return tuple(keys)


def _derived_list(v, where: str, allowed=DERIVED) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _err(where, f"must be a list of derived value names ({', '.join(allowed)}), got {v!r}")
    for x in v:
        if x not in allowed:
            raise _err(where, f"unknown derived value {x!r}; known: {', '.join(allowed)}")
    return tuple(v)


def _factor(t, where: str) -> dict:
    t = _strict(t, ("name", "keys", "varies", "holds", "tolerance", "levels", "tune", "k"), where)
    name = t.get("name")
    if name == "calibration" or "k" in t:
        from k3jax.train.ablate_scaling import parse_calibration

        return parse_calibration(t, where)
    if not is_name(name):
        raise _err(where, f"needs a name of letters, digits and '_', got {name!r}")
    where = f"{where} ({name!r})"
    builtin = FACTORS.get(name, {})
    if not builtin and "keys" not in t:
        raise _err(where, f"unknown factor {name!r}: built-in factors are {', '.join(FACTORS)}; a new factor "
                          "needs its own `keys` and `levels`")
    keys = _declared(t.get("keys", builtin.get("keys")), f"{where}.keys")
    varies = _derived_list(t.get("varies", builtin.get("varies", [])), f"{where}.varies")
    holds = _derived_list(t.get("holds", builtin.get("holds", [])), f"{where}.holds", NUMERIC_DERIVED)
    both = sorted(set(varies) & set(holds))
    if both:
        raise _err(where, f"{', '.join(both)} cannot be both in `varies` and in `holds`")
    tol = t.get("tolerance", 0.01)
    if isinstance(tol, bool) or not isinstance(tol, int | float) or not 0 <= tol < 1:
        raise _err(f"{where}.tolerance", f"must be a number in [0, 1), got {tol!r}")
    levels = t.get("levels", builtin.get("levels"))
    if levels is None:
        raise _err(where, "needs `levels`")
    tune = {}
    if "tune" in t:
        from k3jax.train.ablate_scaling import parse_tune

        tune = parse_tune(t["tune"], f"{where}.tune")
    return {"name": name, "keys": keys, "varies": varies, "holds": holds, "tolerance": float(tol),
            "levels": levels, "tune": tune, "where": where}


def parse(path: str) -> dict:
    """The ablation file at ``path`` as checked, normalized pieces (no config is resolved yet)."""
    if not os.path.isfile(path):
        raise AblationSpecError(f"ablation file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise AblationSpecError(f"{path}: not valid TOML ({e})") from e
    here = os.path.dirname(os.path.abspath(path))
    _strict(doc, ("name", "description", "seeds", "base", "budget", "data", "eval", "aa", "output", "factor",
                  "scaling"), path)
    name = doc.get("name", os.path.splitext(os.path.basename(path))[0])
    if "seeds" not in doc:
        raise _err(path, "needs `seeds` (a count or a list)")
    base = _strict(doc.get("base", {}), ("preset", "config", "model", "train"), f"{path}: [base]")
    if ("preset" in base) == ("config" in base):
        raise _err(f"{path}: [base]", "give exactly one of `preset` (a name) or `config` (a config.json path)")
    if "config" in base:
        cfg_path = os.path.join(here, base["config"])
        if not os.path.isfile(cfg_path):
            raise AblationSpecError(f"{path}: [base] config: no such file {cfg_path!r}")
        base_cfg = from_hf(cfg_path)
    else:
        try:
            base_cfg = get_preset(base["preset"])
        except ConfigError as e:
            raise _err(f"{path}: [base] preset", str(e)) from e
    budget = _strict(doc.get("budget", {}), ("tokens", "steps"), f"{path}: [budget]")
    scaling = None
    if "scaling" in doc:
        from k3jax.train.ablate_scaling import parse_scaling

        if budget:
            raise _err(f"{path}: [budget]", "a [scaling] study sets its budgets in [scaling] budgets")
        scaling = parse_scaling(doc["scaling"], f"{path}: [scaling]")
        bkey, bval = scaling["budgets"][-1]["kind"], scaling["budgets"][-1]["amount"]
    elif len(budget) != 1:
        raise _err(f"{path}: [budget]", "give exactly one of `tokens` (training tokens per run) or `steps`")
    else:
        (bkey, bval), = budget.items()
    data = _strict(doc.get("data", {}), ("files", "max_bytes", "heldout_frac"), f"{path}: [data]")
    files = data.get("files", [])
    if not isinstance(files, list) or not all(isinstance(x, str) for x in files):
        raise _err(f"{path}: [data] files", f"must be a list of paths, got {files!r}")
    hf = data.get("heldout_frac", 0.05)
    if isinstance(hf, bool) or not isinstance(hf, int | float) or not 0 < hf < 1:
        raise _err(f"{path}: [data] heldout_frac", f"must be in (0, 1), got {hf!r}")
    ev = _strict(doc.get("eval", {}), ("windows", "every", "bootstrap"), f"{path}: [eval]")
    aa = _strict(doc.get("aa", {}), ("seed_offset", "repeat"), f"{path}: [aa]")
    if not isinstance(aa.get("repeat", False), bool):
        raise _err(f"{path}: [aa] repeat", f"must be true or false, got {aa['repeat']!r}")
    out = _strict(doc.get("output", {}), ("ckpt_every", "keep_checkpoints"), f"{path}: [output]")
    if not isinstance(out.get("keep_checkpoints", True), bool):
        raise _err(f"{path}: [output] keep_checkpoints", "must be true or false")
    factors = doc.get("factor", [])
    if not isinstance(factors, list) or not factors:
        raise _err(path, "needs at least one [[factor]]")
    fs = [_factor(t, f"{path}: factor #{i + 1}") for i, t in enumerate(factors)]
    dup = sorted({f["name"] for f in fs if [g["name"] for g in fs].count(f["name"]) > 1})
    if dup:
        raise _err(path, f"factor {dup[0]!r} appears twice")
    for f in fs:
        needs = "calibration" if "calibration" in f else "tune" if f["tune"] else None
        if needs and scaling is None:
            raise _err(f"{f['where']}.{'k' if needs == 'calibration' else 'tune'}",
                       f"{'the calibration factor' if needs == 'calibration' else '`tune`'} belongs to a scaling "
                       "study: replace [budget] with [scaling] budgets")
        for k in f["tune"]:
            owner = next((g["name"] for g in fs if f"train.{k}" in g["keys"]), None)
            if owner is not None:
                raise _err(f"{f['where']}.tune.{k}", f"train.{k} is a key of factor {owner!r}: a setting is either "
                                                     "a factor's level or tuned, not both")
    seeds = _seeds(doc["seeds"], f"{path}: seeds")
    off = aa.get("seed_offset")
    if off is not None:
        _pos_int(off, f"{path}: [aa] seed_offset")
        clash = sorted(set(seeds) & {s + off for s in seeds})
        if clash:
            raise _err(f"{path}: [aa] seed_offset", f"A/A seeds (seed + {off}) collide with the seeds: {clash}")
    return {
        "path": path, "name": name, "description": str(doc.get("description", "")), "seeds": seeds,
        "base_cfg": base_cfg, "base_model": _model_overrides(base.get("model", {}), f"{path}: [base] model"),
        "base_train": _train_overrides(base.get("train", {}), f"{path}: [base] train"),
        "budget": (bkey, _pos_int(bval, f"{path}: [budget] {bkey}")),
        "data": {"data": tuple(os.path.join(here, x) for x in files),
                 "max_bytes": _pos_int(data.get("max_bytes", 4 << 20), f"{path}: [data] max_bytes"),
                 "heldout_frac": float(hf)},
        "eval": {"windows": _pos_int(ev.get("windows", 64), f"{path}: [eval] windows"),
                 "every": None if "every" not in ev else _pos_int(ev["every"], f"{path}: [eval] every"),
                 "bootstrap": _pos_int(ev.get("bootstrap", 2000), f"{path}: [eval] bootstrap")},
        "aa": {"seed_offset": off, "repeat": aa.get("repeat", False)},
        "output": {"ckpt_every": _pos_int(out.get("ckpt_every", 25), f"{path}: [output] ckpt_every"),
                   "keep_checkpoints": out.get("keep_checkpoints", True)},
        "factors": fs, "scaling": scaling,
    }


def load_spec(path: str) -> Spec:
    """Parse, resolve and check the ablation file at ``path`` (no training; seconds: shapes only)."""
    from k3jax.train.ablate_check import resolve

    parsed = parse(path)
    if parsed["scaling"] is not None:
        raise AblationSpecError(f"{path}: a scaling study ([scaling]): load it with ablate_scaling.load_study")
    return resolve(parsed)


def canonical(obj) -> str:
    """Canonical JSON (sorted keys, tuples as lists) — what fingerprints hash."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=list)


def sha256(obj) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()


__all__ = ["DERIVED", "FACTORS", "IMPLIED", "LATER_TRAIN_KEYS", "TRAIN_KEYS", "AblationSpecError", "Arm", "Factor",
           "Spec", "canonical", "load_spec", "parse", "sha256"]
