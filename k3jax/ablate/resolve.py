"""Resolving an ablation file's arms and the one-factor guarantee (``k3jax.ablate.parse`` reads the file).

    spec = load_spec("experiments/ablations/latent_moe.toml")         # = resolve(parse(path))
    print(format_diff(spec.base, spec.arms["latent_moe=standard"]))    # every setting and derived value that differs

Every arm becomes its full configuration: the K3Config (``model.*``), the run settings the train loop derives from it
(``run.*``: ``k3jax.train.settings.run_settings``, the loop's own function), the training settings (``train.*``:
budget, data and eval included) and the derived values (``derived.*``). ``resolve`` diffs each arm against the base
and refuses (AblationSpecError: exit 2, the diff in the message) an arm that differs anywhere its factor did not
declare: a key outside ``keys`` (plus IMPLIED), a derived value outside ``varies``, or a ``holds`` value off by more
than ``tolerance``. It also refuses a factor with no level equal to the base, and a level that changes nothing. Arms
that resolve to the same configuration run once (``Arm.run_id``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import numpy as np

from k3jax.ablate.parse import parse, parse_level
from k3jax.ablate.spec import (
    DERIVED,
    IMPLIED,
    LATER_TRAIN_KEYS,
    TRAIN_KEYS,
    AblationSpecError,
    Arm,
    Factor,
    FactorDecl,
    Spec,
    SpecFile,
    canonical,
    is_name,
    sha256,
)
from k3jax.config import ConfigError, K3Config
from k3jax.config.run import LATER_RUN_FIELDS
from k3jax.errors import InputError
from k3jax.model import abstract_params, active_params, count_params
from k3jax.train import data as tdata
from k3jax.train.evaluate import spaced_windows
from k3jax.train.settings import TrainConfig, run_settings, validate

# -------------------------------------------------------------------------------------------- data and windows

@functools.lru_cache(maxsize=4)
def corpus(data: tuple[str, ...], max_bytes: int, heldout_frac: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) tokens exactly as ``k3 train`` splits them."""
    return tdata.split(tdata.load_corpus(data, max_bytes=max_bytes), heldout_frac)


def eval_windows(arm: Arm, *, tuning: bool = False):
    """The held-out windows the train loop evaluates ``arm`` on (``loop._prepare``: the count rounded down to a
    multiple of the devices, at least one each) — a ``Windows`` of [N, T + 1] int32 tokens. ``tuning``: the N - 1
    windows midway between them instead, on which a scaling study picks tuned settings (no token shared with the
    evaluation windows)."""
    t = arm.train
    _, held = corpus(t["data"], t["max_bytes"], t["heldout_frac"])
    n_dev = t["devices"]
    try:
        return spaced_windows(held, num=max(n_dev, t["eval_windows"] // n_dev * n_dev), seq_len=t["seq_len"],
                              vocab=min(arm.cfg.vocab_size, 256), between=tuning)
    except ValueError as e:
        raise AblationSpecError(f"[eval] windows = {t['eval_windows']}: {e}; use fewer windows or a larger "
                                f"[data] heldout_frac") from e


def _data_order(arm: Arm, seed: int) -> str:
    """sha256 of every training batch of ``arm`` at ``seed``, in order (``k3jax.train.data.batch_at``)."""
    t = arm.train
    train_toks, _ = corpus(t["data"], t["max_bytes"], t["heldout_frac"])
    h = hashlib.sha256()
    for step in range(t["steps"]):
        h.update(tdata.batch_at(train_toks, seed=seed, step=step, batch=t["batch"], seq_len=t["seq_len"],
                                vocab=min(arm.cfg.vocab_size, 256)).tobytes())
    return h.hexdigest()


def _derived(arm: Arm, seed: int) -> dict:
    t = arm.train
    return {"params": count_params(abstract_params(arm.cfg, arm.run)), "active_params": active_params(arm.cfg)[0],
            "tokens": t["steps"] * t["batch"] * t["seq_len"], "data_order": _data_order(arm, seed),
            "eval_windows": hashlib.sha256(eval_windows(arm).tokens.tobytes()).hexdigest()}


# ------------------------------------------------------------------------------------------------- one arm

def _train_settings(parsed: SpecFile, over: dict, where: str) -> dict:
    """TrainConfig keywords of one arm: TrainConfig's defaults (devices: 1), the base's, the level's, then the step
    count from the token budget, the eval settings and the data."""
    d = TrainConfig()
    base = {k: getattr(d, k) for k in TRAIN_KEYS if k not in LATER_TRAIN_KEYS} | {"devices": 1} | parsed.base_train
    t = base | over
    t = {k: v for k, v in t.items() if k not in LATER_TRAIN_KEYS or v != getattr(d, k)}  # absent = the default
    kind, n = parsed.budget
    per_step = t["batch"] * t["seq_len"]
    if kind == "tokens" and n % per_step:
        raise AblationSpecError(f"{where}: [budget] tokens = {n} is not a whole number of steps of batch x seq_len "
                                f"= {t['batch']} x {t['seq_len']} = {per_step} tokens")
    steps = n // per_step if kind == "tokens" else n
    if steps < 1:
        raise AblationSpecError(f"{where}: [budget] tokens = {n} is less than one step ({per_step} tokens)")
    # the default eval interval is the base's (an arm with another batch shape still evaluates at the same steps)
    every = parsed.eval_every or max(1, (n // (base["batch"] * base["seq_len"]) if kind == "tokens" else n) // 8)
    return t | {"steps": steps, "eval_every": every, "eval_windows": parsed.eval_windows} | parsed.data


def _train_config(cfg: K3Config, train: dict, where: str) -> TrainConfig:
    """The arm's TrainConfig (seed 0), checked as `k3 train` checks its flags."""
    n_dev = train["devices"]
    if n_dev is None or n_dev < 1 or n_dev > len(jax.devices()):
        raise AblationSpecError(f"{where}: train.devices = {n_dev}: {len(jax.devices())} device(s) available")
    try:
        tc = TrainConfig(preset=None, model=cfg, seed=0, **train)
        validate(tc, n_dev)
    except InputError as e:
        raise AblationSpecError(f"{where}: {e}") from e
    return tc


def make_arm(parsed: SpecFile, name: str, factor, level, cfg: K3Config, train_over: dict, where: str) -> Arm:
    """One arm: ``cfg`` trained with the file's settings plus ``train_over``, checked, flattened and derived."""
    train = _train_settings(parsed, train_over, where)
    run = run_settings(_train_config(cfg, train, where), cfg)
    flat = ({f"model.{k}": v for k, v in cfg.to_dict().items()}
            | {f"run.{k}": v for k, v in dataclasses.asdict(run).items()
               if k not in LATER_RUN_FIELDS or v != LATER_RUN_FIELDS[k]}
            | {f"train.{k}": (list(v) if isinstance(v, tuple) else v) for k, v in train.items()})
    arm = Arm(name, factor, level, cfg, train, run, flat, {})
    return dataclasses.replace(arm, derived=_derived(arm, parsed.seeds[0]))


def with_overrides(cfg: K3Config, over: dict, where: str) -> K3Config:
    """``cfg`` with the K3Config overrides ``over``; a config they make invalid is an AblationSpecError at ``where``."""
    try:
        return cfg.replace(**over)
    except ConfigError as e:
        raise AblationSpecError(f"{where}: {e}") from e


# ------------------------------------------------------------------------------------------ the one-factor check

def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, str) and len(v) == 64:
        return v[:12] + "…"  # a sha256
    return repr(v)


def diff(base: Arm, arm: Arm) -> dict[str, tuple]:
    """{key: (base value, arm value)} over the flat settings and ``derived.*`` values that differ."""
    a = base.flat | {f"derived.{k}": v for k, v in base.derived.items()}
    b = arm.flat | {f"derived.{k}": v for k, v in arm.derived.items()}
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def violations(f: Factor, base: Arm, arm: Arm) -> dict[str, str]:
    """{key: why} for every way ``arm`` breaks factor ``f``'s declaration."""
    allowed = set(f.keys) | {i for k in f.keys for i in IMPLIED.get(k, ())} | {f"train.{k}" for k in f.tune}
    out = {}
    for k in diff(base, arm):
        name = k.removeprefix("derived.")
        if k.startswith("derived."):
            if name not in f.varies and name not in f.holds:
                out[k] = f"derived value not declared by factor {f.name!r} (add it to `varies` or `holds`)"
        elif k not in allowed:
            out[k] = f"not a declared key of factor {f.name!r}"
    for name in f.holds:
        a, b = base.derived[name], arm.derived[name]
        rel = abs(b - a) / max(abs(a), 1)
        if rel > f.tolerance:
            out[f"derived.{name}"] = (f"factor {f.name!r} holds {name} within {f.tolerance:.2%}; "
                                      f"off by {rel:.2%}")
    return out


def format_diff(base: Arm, arm: Arm, bad: dict[str, str] | None = None) -> str:
    """One line per differing key, ``!`` marking the violations with their reason."""
    bad = bad or {}
    lines = []
    for k, (a, b) in diff(base, arm).items():
        rel = ""
        if k.startswith("derived.") and isinstance(a, int) and isinstance(b, int) and a:
            rel = f" ({(b - a) / a:+.2%})"
        why = f"    <- {bad[k]}" if k in bad else ""
        lines.append(f"  {'!' if k in bad else ' '} {k:<36} {_fmt(a)} -> {_fmt(b)}{rel}{why}")
    return "\n".join(lines)


def _check_factor(path: str, f: Factor, base: Arm, arms: dict) -> list[str]:
    errors = []
    for level, name in f.levels.items():
        if name == "base":
            continue
        bad = violations(f, base, arms[name])
        if bad:
            declared = (f"keys: {', '.join(f.keys)}; varies: {', '.join(f.varies) or '-'}; "
                        f"holds: {', '.join(f.holds) or '-'}")
            errors.append(f"{path}: factor {f.name!r} level {level!r} differs from the base outside its declaration "
                          f"({declared}):\n{format_diff(base, arms[name], bad)}")
    return errors


# ------------------------------------------------------------------------------------------------------ resolve

def level_tables(f: FactorDecl, cfg: K3Config) -> dict:
    """Factor ``f``'s level tables for the base config ``cfg`` (a built-in factor's may depend on it)."""
    return f.levels(cfg) if callable(f.levels) else f.levels


def _levels(parsed: SpecFile, f: FactorDecl, base_cfg: K3Config, base: Arm) -> tuple[dict, str]:
    """(level -> Arm, the base level's name); finds the base level and refuses levels that change nothing. The
    settings a factor tunes are left out of both comparisons: its base level is the one equal to the base elsewhere."""
    table = level_tables(f, base_cfg)
    tuned = {f"train.{k}" for k in f.tune}

    def core(arm):
        return {k: v for k, v in arm.flat.items() if k not in tuned}

    where = f.where
    if not isinstance(table, dict) or not table:
        raise AblationSpecError(f"{where}: `levels` must be a non-empty table of level tables")
    arms, base_level = {}, None
    for level, t in table.items():
        lw = f"{where} level {level!r}"
        if not is_name(level):
            raise AblationSpecError(f"{lw}: level names are letters, digits and '_' (they name run directories)")
        model_over, train_over = parse_level(t, lw)
        arm = make_arm(parsed, f"{f.name}={level}", f.name, level, with_overrides(base_cfg, model_over, lw),
                       train_over, lw)
        if core(arm) == core(base):
            if base_level is not None:
                raise AblationSpecError(f"{lw}: does not change anything: it resolves to the base configuration, "
                                        f"as level {base_level!r} does")
            base_level = level
        arms[level] = arm
    if base_level is None:
        raise AblationSpecError(f"{where}: no level resolves to the base configuration; add the base as a level "
                                f"(e.g. `{next(iter(table))}_base = {{}}`) so each level has a paired baseline")
    if len(arms) < 2:
        raise AblationSpecError(f"{where}: level {base_level!r} is the base itself: a factor needs a second level")
    return arms, base_level


def resolve(parsed: SpecFile) -> Spec:
    """The checked ``Spec`` of a parsed file: every arm resolved, derived, diffed and deduplicated (a scaling study's
    calibration factor is left out: ``k3jax.ablate.study.calibrate`` adds it per budget)."""
    path = parsed.path
    base_cfg = with_overrides(parsed.base_cfg, parsed.base_model, f"{path}: [base] model")
    base = make_arm(parsed, "base", None, None, base_cfg, {}, f"{path}: [base]")
    arms, factors, errors = {"base": base}, [], []
    for f in parsed.factors:
        if f.calibration is not None:
            continue
        level_arms, base_level = _levels(parsed, f, base_cfg, base)
        names = {lv: ("base" if a.flat == base.flat else a.name) for lv, a in level_arms.items()}
        fac = Factor(f.name, f.keys, f.varies, f.holds, f.tolerance, names, base_level, f.tune)
        arms |= {a.name: a for lv, a in level_arms.items() if names[lv] != "base"}
        errors += _check_factor(path, fac, base, arms)
        factors.append(fac)
    if errors:
        raise AblationSpecError("\n".join(errors))
    # identical configurations run once, under the first arm's name
    first: dict[str, str] = {}
    arms = {n: dataclasses.replace(a, run_id=first.setdefault(canonical(a.flat), n)) for n, a in arms.items()}
    runs = {a.run_id: arms[a.run_id] for a in arms.values()}
    fingerprint = sha256({
        "seeds": parsed.seeds, "aa": parsed.aa, "bootstrap": parsed.bootstrap,
        "arms": {n: {"flat": a.flat, "derived": a.derived, "run_id": a.run_id} for n, a in arms.items()},
        "factors": [dataclasses.asdict(f) for f in factors]})
    return Spec(path=path, name=parsed.name, description=parsed.description, seeds=parsed.seeds,
                base=arms["base"], factors=tuple(factors), arms=arms, runs=runs, aa=parsed.aa,
                bootstrap=parsed.bootstrap, output=parsed.output, fingerprint=fingerprint)


def load_spec(path: str) -> Spec:
    """Parse, resolve and check the ablation file at ``path`` (no training; seconds: shapes only)."""
    parsed = parse(path)
    if parsed.scaling is not None:
        raise AblationSpecError(f"{path}: a scaling study ([scaling]): load it with k3jax.ablate.load "
                                "(or k3jax.ablate.study.load_study)")
    return resolve(parsed)


__all__ = ["DERIVED", "corpus", "diff", "eval_windows", "format_diff", "level_tables", "load_spec", "make_arm",
           "resolve", "violations", "with_overrides"]
