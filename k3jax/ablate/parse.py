"""Reading an ablation file for `k3 ablate`: the TOML checked table by table into a ``SpecFile`` (nothing resolved
yet; ``k3jax.ablate.resolve`` turns it into arms and checks the one-factor guarantee). Bad input raises
``AblationSpecError`` (a ValueError: exit 2) naming the file, table and key.

    parsed = parse("experiments/ablations/attn_res.toml")
    parsed.factors[0].keys                                            # ("model.attn_res_block_size",)

Schema (every table is strict: an unknown key is an error that names it):

    kind = "training"                        # optional; "decoding": arms that differ in decoding settings only
                                             # (a schema of its own: k3jax/ablate/decoding.py)
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

A scaling study (``k3jax.ablate.study``) replaces [budget] with::

    [scaling]
    budgets = [{ tokens = 16384 }, { tokens = 32768 }, { tokens = 65536 }, { tokens = 131072 }]
                                  # each: `tokens` or `steps`; optional `width` (a multiplier of the base's widths:
                                  # hidden size, heads, low-rank and FFN sizes; head dims and expert counts stay) and
                                  # `name` (default b0, b1, ...); >= 4 budgets, increasing in compute, spanning >= 8x
    fit = "auto"                  # "saturating" L = E + A·C^(−α), "power" (E = 0), or "auto": saturating where every
                                  # arm's points identify E (k3jax.analysis.scaling_fit)
    bootstrap = 1000              # resamples of seeds and held-out windows behind every interval
    window = 3                    # budgets per local fit behind the multipliers (default 3; >= 3, at most all)

and its factors may add::

    tune = { lr = [1e-3, 3e-3, 1e-2] }     # in a [[factor]]: each level (its base level too) picks its own value per
                                           # budget on the tuning windows, at the first seed; then runs all seeds
    [[factor]]
    name = "calibration"                   # the known multiplier: its level trains the base on k x the tokens (k x
    k = 1.5                                # the steps, whole at every budget) and the study reports the base's compute
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib

from k3jax.ablate.spec import (
    DERIVED,
    FACTORS,
    MODEL_FIELDS,
    NUMERIC_DERIVED,
    TRAIN_KEYS,
    AblationSpecError,
    BudgetDecl,
    FactorDecl,
    Scaling,
    SpecFile,
    coerce,
    err,
    is_int,
    is_name,
    pos_int,
    strict,
)
from k3jax.analysis.scaling_fit import FORMS as FIT_FORMS
from k3jax.config import ConfigError, from_hf, get_preset
from k3jax.train.settings import TrainConfig

MIN_BUDGETS = 4
KINDS = ("training", "decoding")
_TRAIN_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


# ------------------------------------------------------------------------------------------- settings and levels

def _model_overrides(table, where: str) -> dict:
    strict(table, MODEL_FIELDS, where)
    return {k: coerce(f"{where}.{k}", v, MODEL_FIELDS[k].type, MODEL_FIELDS[k].default) for k, v in table.items()}


def _train_overrides(table, where: str) -> dict:
    set_elsewhere = {"steps": "[budget]", "total_steps": "[budget]", "seed": "`seeds`", "data": "[data]",
                     "max_bytes": "[data]", "heldout_frac": "[data]", "eval_every": "[eval]",
                     "eval_windows": "[eval]", "ckpt_every": "[output]"}
    for k in table if isinstance(table, dict) else ():
        if k in set_elsewhere:
            raise err(f"{where}.{k}", f"set by {set_elsewhere[k]} for every arm, not per level")
    strict(table, TRAIN_KEYS, where)
    return {k: coerce(f"{where}.{k}", v, _TRAIN_FIELDS[k].type, _TRAIN_FIELDS[k].default) for k, v in table.items()}


def parse_level(table, where: str) -> tuple[dict, dict]:
    """A level table ``{model = {...}, train = {...}}`` as (K3Config overrides, TrainConfig keywords)."""
    strict(table, ("model", "train"), where)
    return _model_overrides(table.get("model", {}), f"{where}.model"), _train_overrides(table.get("train", {}),
                                                                                      f"{where}.train")


def parse_seeds(v, where: str) -> tuple[int, ...]:
    if is_int(v):
        return tuple(range(pos_int(v, where)))
    if not isinstance(v, list) or not v or not all(is_int(s) and s >= 0 for s in v):
        raise err(where, f"must be a positive integer (a count) or a non-empty list of non-negative integers, "
                         f"got {v!r}")
    if len(set(v)) != len(v):
        raise err(where, f"repeats a seed: {v}")
    return tuple(v)


def _declared(keys, where: str) -> tuple[str, ...]:
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise err(where, f"must be a non-empty list of \"model.<field>\" / \"train.<setting>\" names, got {keys!r}")
    for k in keys:
        sect, _, name = k.partition(".")
        known = MODEL_FIELDS if sect == "model" else TRAIN_KEYS if sect == "train" else None
        if known is None or name not in known:
            near = difflib.get_close_matches(k, [f"model.{f}" for f in MODEL_FIELDS] + [f"train.{t}" for t in
                                                                                         TRAIN_KEYS], n=1)
            raise err(where, f"unknown key {k!r}" + (f" (did you mean {near[0]!r}?)" if near else
                                                       " (keys are model.<K3Config field> or train.<setting>)"))
    return tuple(keys)


def _derived_list(v, where: str, allowed=DERIVED) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise err(where, f"must be a list of derived value names ({', '.join(allowed)}), got {v!r}")
    for x in v:
        if x not in allowed:
            raise err(where, f"unknown derived value {x!r}; known: {', '.join(allowed)}")
    return tuple(v)


# ------------------------------------------------------------------------------------------- a scaling study's

def parse_scaling(table, where: str) -> Scaling:
    """[scaling]: its budgets and fit settings."""
    t = strict(table, ("budgets", "fit", "bootstrap", "window"), where)
    budgets = t.get("budgets")
    if not isinstance(budgets, list) or len(budgets) < MIN_BUDGETS:
        n = len(budgets) if isinstance(budgets, list) else 0
        raise err(f"{where} budgets", f"{n} budget(s): a scaling fit needs at least {MIN_BUDGETS} "
                                      "(a list of { tokens = N } / { steps = N } tables)")
    out = []
    for i, b in enumerate(budgets):
        bw = f"{where} budgets[{i}]"
        b = strict(b, ("name", "tokens", "steps", "width"), bw)
        kinds = [k for k in ("tokens", "steps") if k in b]
        if len(kinds) != 1:
            raise err(bw, "give exactly one of `tokens` or `steps`")
        width = b.get("width", 1.0)
        if isinstance(width, bool) or not isinstance(width, int | float) or not width > 0:
            raise err(f"{bw}.width", f"must be a positive number (a multiplier of the base's widths), got {width!r}")
        name = b.get("name", f"b{i}")
        if not is_name(name):
            raise err(f"{bw}.name", f"letters, digits and '_' only (it names a directory), got {name!r}")
        out.append(BudgetDecl(name, kinds[0], pos_int(b[kinds[0]], f"{bw}.{kinds[0]}"), float(width)))
    names = [b.name for b in out]
    if len(set(names)) != len(names):
        raise err(f"{where} budgets", f"repeats a budget name: {names}")
    fit = t.get("fit", "auto")
    if fit not in FIT_FORMS:
        raise err(f"{where} fit", f"must be one of {', '.join(FIT_FORMS)}, got {fit!r}")
    window = t.get("window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 3 <= window <= len(out)):
        raise err(f"{where} window", f"must be a whole number of budgets in [3, {len(out)}] (a local power law with "
                                     f"a degree of freedom left, at most every budget), got {window!r}")
    return Scaling(tuple(out), fit, pos_int(t.get("bootstrap", 1000), f"{where} bootstrap"), window)


def parse_tune(t, where: str) -> dict:
    """A factor's ``tune = { lr = [...] }``: the training settings each of its levels tunes, with their candidates."""
    strict(t, [k for k in TRAIN_KEYS if k != "devices"], where)
    out = {}
    for k, vals in t.items():
        if not isinstance(vals, list) or len(vals) < 2:
            raise err(f"{where}.{k}", f"must be a list of at least 2 candidate values, got {vals!r}")
        vals = tuple(coerce(f"{where}.{k}", v, _TRAIN_FIELDS[k].type, _TRAIN_FIELDS[k].default) for v in vals)
        if len(set(vals)) != len(vals):
            raise err(f"{where}.{k}", f"repeats a value: {list(vals)}")
        out[k] = vals
    if not out:
        raise err(where, "names no setting to tune")
    return out


def parse_calibration(t, where: str) -> FactorDecl:
    """The calibration factor: ``name = "calibration"`` and ``k`` (the known multiplier), nothing else."""
    other = sorted(set(t) - {"name", "k"})
    if t.get("name") != "calibration":
        raise err(f"{where}.k", "`k` belongs to the factor named \"calibration\"")
    if other:
        raise err(f"{where}.{other[0]}", "the calibration factor takes `k` only (its level is the base trained on "
                                         "k x the tokens; it cannot be combined with other keys)")
    k = t.get("k")
    if isinstance(k, bool) or not isinstance(k, int | float) or not k > 0 or k == 1:
        raise err(f"{where}.k", f"must be a positive number other than 1 (the known multiplier), got {k!r}")
    return FactorDecl("calibration", ("train.steps",), ("tokens", "data_order"), (), 0.0, None, {},
                      f"{where} ('calibration')", calibration=float(k))


# ------------------------------------------------------------------------------------------------- the file

def _factor(t, where: str) -> FactorDecl:
    t = strict(t, ("name", "keys", "varies", "holds", "tolerance", "levels", "tune", "k"), where)
    name = t.get("name")
    if name == "calibration" or "k" in t:
        return parse_calibration(t, where)
    if not is_name(name):
        raise err(where, f"needs a name of letters, digits and '_', got {name!r}")
    where = f"{where} ({name!r})"
    builtin = FACTORS.get(name, {})
    if not builtin and "keys" not in t:
        raise err(where, f"unknown factor {name!r}: built-in factors are {', '.join(FACTORS)}; a new factor "
                         "needs its own `keys` and `levels`")
    keys = _declared(t.get("keys", builtin.get("keys")), f"{where}.keys")
    varies = _derived_list(t.get("varies", builtin.get("varies", [])), f"{where}.varies")
    holds = _derived_list(t.get("holds", builtin.get("holds", [])), f"{where}.holds", NUMERIC_DERIVED)
    both = sorted(set(varies) & set(holds))
    if both:
        raise err(where, f"{', '.join(both)} cannot be both in `varies` and in `holds`")
    tol = t.get("tolerance", 0.01)
    if isinstance(tol, bool) or not isinstance(tol, int | float) or not 0 <= tol < 1:
        raise err(f"{where}.tolerance", f"must be a number in [0, 1), got {tol!r}")
    levels = t.get("levels", builtin.get("levels"))
    if levels is None:
        raise err(where, "needs `levels`")
    tune = parse_tune(t["tune"], f"{where}.tune") if "tune" in t else {}
    return FactorDecl(name, keys, varies, holds, float(tol), levels, tune, where)


def _base_config(base: dict, here: str, path: str):
    if ("preset" in base) == ("config" in base):
        raise err(f"{path}: [base]", "give exactly one of `preset` (a name) or `config` (a config.json path)")
    if "config" in base:
        cfg_path = os.path.join(here, base["config"])
        if not os.path.isfile(cfg_path):
            raise AblationSpecError(f"{path}: [base] config: no such file {cfg_path!r}")
        return from_hf(cfg_path)
    try:
        return get_preset(base["preset"])
    except ConfigError as e:
        raise err(f"{path}: [base] preset", str(e)) from e


def _check_factors(fs: list[FactorDecl], scaling: Scaling | None, path: str) -> None:
    """Factor names are distinct; `tune` and the calibration factor belong to scaling studies; a tuned setting is no
    factor's key."""
    dup = sorted({f.name for f in fs if [g.name for g in fs].count(f.name) > 1})
    if dup:
        raise err(path, f"factor {dup[0]!r} appears twice")
    for f in fs:
        needs = "calibration" if f.calibration is not None else "tune" if f.tune else None
        if needs and scaling is None:
            raise err(f"{f.where}.{'k' if needs == 'calibration' else 'tune'}",
                      f"{'the calibration factor' if needs == 'calibration' else '`tune`'} belongs to a scaling "
                      "study: replace [budget] with [scaling] budgets")
        for k in f.tune:
            owner = next((g.name for g in fs if f"train.{k}" in g.keys), None)
            if owner is not None:
                raise err(f"{f.where}.tune.{k}", f"train.{k} is a key of factor {owner!r}: a setting is either "
                                                 "a factor's level or tuned, not both")


def read_toml(path: str) -> dict:
    """The TOML document of the ablation file at ``path`` (an AblationSpecError when missing or malformed)."""
    if not os.path.isfile(path):
        raise AblationSpecError(f"ablation file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise AblationSpecError(f"{path}: not valid TOML ({e})") from e


def file_kind(doc: dict, path: str) -> str:
    """An ablation file's ``kind``: "training" (the default: arms that train) or "decoding" (arms that differ in
    decoding settings only, on one trained model: ``k3jax.ablate.decoding``)."""
    kind = doc.get("kind", "training")
    if kind not in KINDS:
        raise err(f"{path}: kind", f"must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    return kind


def parse(path: str) -> SpecFile:
    """The ablation file at ``path`` as checked, normalized values (no config is resolved yet)."""
    doc = read_toml(path)
    if file_kind(doc, path) != "training":
        raise err(f"{path}: kind", "a decoding study: load it with k3jax.ablate.load (k3jax.ablate.decoding)")
    here = os.path.dirname(os.path.abspath(path))
    strict(doc, ("kind", "name", "description", "seeds", "base", "budget", "data", "eval", "aa", "output", "factor",
                 "scaling"), path)
    name = doc.get("name", os.path.splitext(os.path.basename(path))[0])
    if "seeds" not in doc:
        raise err(path, "needs `seeds` (a count or a list)")
    base = strict(doc.get("base", {}), ("preset", "config", "model", "train"), f"{path}: [base]")
    base_cfg = _base_config(base, here, path)
    budget = strict(doc.get("budget", {}), ("tokens", "steps"), f"{path}: [budget]")
    scaling = None
    if "scaling" in doc:
        if budget:
            raise err(f"{path}: [budget]", "a [scaling] study sets its budgets in [scaling] budgets")
        scaling = parse_scaling(doc["scaling"], f"{path}: [scaling]")
        bkey, bval = scaling.budgets[-1].kind, scaling.budgets[-1].amount
    elif len(budget) != 1:
        raise err(f"{path}: [budget]", "give exactly one of `tokens` (training tokens per run) or `steps`")
    else:
        (bkey, bval), = budget.items()
    data = strict(doc.get("data", {}), ("files", "max_bytes", "heldout_frac"), f"{path}: [data]")
    files = data.get("files", [])
    if not isinstance(files, list) or not all(isinstance(x, str) for x in files):
        raise err(f"{path}: [data] files", f"must be a list of paths, got {files!r}")
    hf = data.get("heldout_frac", TrainConfig.heldout_frac)
    if isinstance(hf, bool) or not isinstance(hf, int | float) or not 0 < hf < 1:
        raise err(f"{path}: [data] heldout_frac", f"must be in (0, 1), got {hf!r}")
    ev = strict(doc.get("eval", {}), ("windows", "every", "bootstrap"), f"{path}: [eval]")
    aa = strict(doc.get("aa", {}), ("seed_offset", "repeat"), f"{path}: [aa]")
    if not isinstance(aa.get("repeat", False), bool):
        raise err(f"{path}: [aa] repeat", f"must be true or false, got {aa['repeat']!r}")
    out = strict(doc.get("output", {}), ("ckpt_every", "keep_checkpoints"), f"{path}: [output]")
    if not isinstance(out.get("keep_checkpoints", True), bool):
        raise err(f"{path}: [output] keep_checkpoints", "must be true or false")
    factors = doc.get("factor", [])
    if not isinstance(factors, list) or not factors:
        raise err(path, "needs at least one [[factor]]")
    fs = [_factor(t, f"{path}: factor #{i + 1}") for i, t in enumerate(factors)]
    _check_factors(fs, scaling, path)
    seeds = parse_seeds(doc["seeds"], f"{path}: seeds")
    off = aa.get("seed_offset")
    if off is not None:
        pos_int(off, f"{path}: [aa] seed_offset")
        clash = sorted(set(seeds) & {s + off for s in seeds})
        if clash:
            raise err(f"{path}: [aa] seed_offset", f"A/A seeds (seed + {off}) collide with the seeds: {clash}")
    return SpecFile(
        path=path, name=name, description=str(doc.get("description", "")), seeds=seeds, base_cfg=base_cfg,
        base_model=_model_overrides(base.get("model", {}), f"{path}: [base] model"),
        base_train=_train_overrides(base.get("train", {}), f"{path}: [base] train"),
        budget=(bkey, pos_int(bval, f"{path}: [budget] {bkey}")),
        data={"data": tuple(os.path.join(here, x) for x in files),
              "max_bytes": pos_int(data.get("max_bytes", TrainConfig.max_bytes), f"{path}: [data] max_bytes"),
              "heldout_frac": float(hf)},
        eval_windows=pos_int(ev.get("windows", 64), f"{path}: [eval] windows"),
        eval_every=None if "every" not in ev else pos_int(ev["every"], f"{path}: [eval] every"),
        bootstrap=pos_int(ev.get("bootstrap", 2000), f"{path}: [eval] bootstrap"),
        aa={"seed_offset": off, "repeat": aa.get("repeat", False)},
        output={"ckpt_every": pos_int(out.get("ckpt_every", 25), f"{path}: [output] ckpt_every"),
                "keep_checkpoints": out.get("keep_checkpoints", True)},
        factors=tuple(fs), scaling=scaling)


__all__ = ["FIT_FORMS", "KINDS", "MIN_BUDGETS", "file_kind", "parse", "parse_calibration", "parse_level",
           "parse_scaling", "parse_seeds", "parse_tune", "read_toml"]
