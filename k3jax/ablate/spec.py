"""What an ablation is made of: the values an ablation file parses to (``SpecFile``, ``FactorDecl``, ``Scaling``,
``BudgetDecl``: checked, nothing resolved yet), the resolved arms (``Arm``, ``Factor``, ``Spec``), the built-in
factors (``FACTORS``), the setting names a file may use, and the strict-input helpers the parser uses (``strict``,
``coerce``, ``pos_int``, ``err``: an error names the file, table and key). ``k3jax.ablate.parse`` reads a file into
these types and has its schema; ``k3jax.ablate.resolve`` turns a ``SpecFile`` into a ``Spec``.

Derived values (DERIVED): params and active_params (``k3 plan``'s counts), tokens (steps x batch x seq_len),
data_order (sha256 of every training batch at the first seed) and eval_windows (sha256 of the held-out windows).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3jax.config import K3Config, RunConfig, k3_full_attn_layers
from k3jax.errors import InputError
from k3jax.train.settings import ablatable_keys, later_ablatable_keys

DERIVED = ("params", "active_params", "tokens", "data_order", "eval_windows")
NUMERIC_DERIVED = ("params", "active_params", "tokens")
# The training settings a file may set, from TrainConfig's field metadata (k3jax.train.settings: ``ablate``); the
# later ones were added after ablation files and their recorded directories existed: an arm's resolved settings hold
# one only when it differs from TrainConfig's default, so earlier files keep their fingerprints.
TRAIN_KEYS = ablatable_keys()
LATER_TRAIN_KEYS = later_ablatable_keys()
# Settings that follow from a declared key: the RunConfig mirrors of two training settings, the step count that a
# token budget gives for another batch shape.
IMPLIED = {"train.qat": ("run.qat",), "train.compute_dtype": ("run.compute_dtype",),
           "train.batch": ("train.steps",), "train.seq_len": ("train.steps",)}
# The K3Config fields a file's `model = {...}` tables may set.
MODEL_FIELDS = {f.name: f for f in dataclasses.fields(K3Config) if f.name not in ("name", "extra")}


class AblationSpecError(InputError):
    """A malformed ablation file, or one whose arms break the one-factor guarantee; the message names the key."""


# ------------------------------------------------------------------------------------------- strict input helpers

def err(where: str, msg: str) -> AblationSpecError:
    """The error for ``where`` (file, table and key) with ``msg``."""
    return AblationSpecError(f"{where}: {msg}")


def strict(table, allowed, where: str) -> dict:
    """``table`` if it is a table whose keys are all in ``allowed``; else an error naming the unknown key (and the
    nearest known one)."""
    if not isinstance(table, dict):
        raise err(where, f"must be a table, got {type(table).__name__}")
    for k in table:
        if k not in allowed:
            near = difflib.get_close_matches(k, list(allowed), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; known keys: {', '.join(sorted(allowed))}"
            raise err(where, f"unknown key {k!r}{hint}")
    return table


def is_int(v) -> bool:
    """An integer that is not a bool (TOML's true is not a count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def pos_int(v, where: str) -> int:
    """``v`` if it is a positive integer; else an error."""
    if not is_int(v) or v < 1:
        raise err(where, f"must be a positive integer, got {v!r}")
    return v


def coerce(where: str, value, ftype: str, default):
    """A TOML value as a field of type ``ftype`` (dataclass annotation text): "none" -> None for optional fields,
    lists -> tuples, ints -> floats for float fields; anything else of the wrong type is an error."""
    if value == "none" and "None" in ftype:
        return None
    if "tuple" in ftype:
        if not isinstance(value, list) or not all(is_int(i) for i in value):
            raise err(where, f"must be a list of integers, got {value!r}")
        return tuple(value)
    if isinstance(default, bool) or ftype == "bool":
        if not isinstance(value, bool):
            raise err(where, f"must be true or false, got {value!r}")
        return value
    if "float" in ftype:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise err(where, f"must be a number{' or \"none\"' if 'None' in ftype else ''}, got {value!r}")
        return float(value)
    if "int" in ftype:
        if not is_int(value):
            raise err(where, f"must be an integer{' or \"none\"' if 'None' in ftype else ''}, got {value!r}")
        return value
    if not isinstance(value, str):
        raise err(where, f"must be a string, got {value!r}")
    return value


def is_name(x) -> bool:
    """Factor and level names become directory names: letters, digits and '_' only."""
    return isinstance(x, str) and x != "" and x.isascii() and x.replace("_", "").isalnum()


# ---------------------------------------------------------------------------------------------- built-in factors

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


# ------------------------------------------------------------------------------------------ a file, as parsed

@dataclass(frozen=True)
class FactorDecl:
    """One [[factor]] table as checked: its declaration and its level tables, not yet resolved to arms."""

    name: str
    keys: tuple[str, ...]
    varies: tuple[str, ...]
    holds: tuple[str, ...]
    tolerance: float
    levels: dict | Callable[[K3Config], dict] | None  # level -> {"model": ..., "train": ...}; None: calibration's
    tune: dict  # tuned training setting -> candidates (a scaling study's factors); {} when none
    where: str  # where in the file, for messages
    calibration: float | None = None  # the calibration factor's k (a scaling study's)


@dataclass(frozen=True)
class BudgetDecl:
    """One budget of a scaling study: ``amount`` tokens or steps, at ``width`` x the base's widths."""

    name: str
    kind: str  # "tokens" | "steps"
    amount: int
    width: float


@dataclass(frozen=True)
class Scaling:
    """A file's [scaling] table: its budgets and the fit settings (window None: the report's default)."""

    budgets: tuple[BudgetDecl, ...]
    fit: str
    bootstrap: int
    window: int | None


@dataclass(frozen=True)
class SpecFile:
    """An ablation file as checked, normalized values (no config resolved yet): ``k3jax.ablate.parse.parse``'s."""

    path: str
    name: str
    description: str
    seeds: tuple[int, ...]
    base_cfg: K3Config  # the preset or config.json, before the [base] model overrides
    base_model: dict  # [base] model: K3Config overrides
    base_train: dict  # [base] train: TrainConfig keywords
    budget: tuple[str, int]  # ("tokens" | "steps", amount); a scaling study: its largest budget until resolved
    data: dict  # TrainConfig keywords: data, max_bytes, heldout_frac
    eval_windows: int
    eval_every: int | None  # None: the base's steps // 8
    bootstrap: int
    aa: dict  # {"seed_offset": int | None, "repeat": bool}
    output: dict  # {"ckpt_every", "keep_checkpoints"}
    factors: tuple[FactorDecl, ...]
    scaling: Scaling | None = None


# ------------------------------------------------------------------------------------------- resolved arms

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


def canonical(obj) -> str:
    """Canonical JSON (sorted keys, tuples as lists) — what fingerprints hash."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=list)


def sha256(obj) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()


__all__ = ["DERIVED", "FACTORS", "IMPLIED", "LATER_TRAIN_KEYS", "MODEL_FIELDS", "NUMERIC_DERIVED", "TRAIN_KEYS",
           "AblationSpecError", "Arm", "BudgetDecl", "Factor", "FactorDecl", "Scaling", "Spec", "SpecFile",
           "canonical", "coerce", "err", "is_int", "is_name", "pos_int", "sha256", "strict"]
