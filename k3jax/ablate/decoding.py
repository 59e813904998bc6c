"""Decoding studies for `k3 ablate` (``kind = "decoding"``): one trained model, arms that differ in decoding
settings only — draft on or off, draft tokens K, the rollback mode, the sampler — each generating from the same
tokenized prompts with the same output limits, per prompt category (``k3jax.draft.measure``). This module reads and
checks the file into a ``DecodingSpec``; ``k3jax.ablate.decoding_run`` runs it and writes the tables.

    spec = load_decoding("experiments/ablations/speculative.toml")      # checked; no weight read, nothing run
    print(describe_decoding(spec))

Schema (every table strict: an unknown key is an error naming it)::

    kind = "decoding"
    name = "speculative"                     # optional; default: the file's stem
    description = "..."
    seeds = 1                                # the sampler's seeds (greedy: repeats); a count or a list
    [base]
    ckpt = "shipped"                         # the shipped k3-mini (default), or a checkpoint directory relative to
                                             # this file; or preset = "k3-tiny" (random init, seed 0): one of them
    dtype = "float32"                        # or "bfloat16"
    decoding = { draft = false }             # the base's decoding settings (DECODING below gives the defaults)
    [prompts]
    categories = ["low_entropy", "high_entropy"]   # default: both (k3jax/draft/measure.py)
    count = 8                                # prompts per category: one batch
    length = 64                              # tokens per prompt
    max_new_tokens = 64                      # tokens generated per row, by every arm
    [aa]
    repeat = true                            # the base again at every seed (arm "base~aa"): the timing's noise, and
                                             # tokens that must equal the base's
    [[factor]]
    name = "draft"
    keys = ["decoding.draft"]                # optional: the key its levels may change
    levels = { off = {}, on = { decoding = { draft = true } } }

Decoding keys: ``draft`` (bool), ``drafter`` ("shipped": the draft/ directory inside the checkpoint; "random": a
draft at random init; "self": the target drafting for itself; or a draft directory relative to this file),
``draft_tokens`` (K), ``rollback`` ("copy" | "replay"), ``greedy`` (bool), ``temperature``, ``top_k``, ``top_p``.

The one-factor check: each level of a factor differs from the base in exactly one decoding key (a level changing two
is refused, exit 2, naming both), or in none (the factor's base level: exactly one such level per factor). A key
without effect in both settings — ``drafter``, ``draft_tokens`` or ``rollback`` with the draft off, a sampling
parameter under greedy — does not count as a change: the level is refused as changing nothing. Every drafter an arm
uses is checked against the model (``k3jax.draft.measure.draft_source``) before any weight is read. Arms that resolve
to the same settings run once (``Arm.run_id``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from k3jax.ablate.parse import file_kind, parse_seeds, read_toml
from k3jax.ablate.resolve import diff, format_diff
from k3jax.ablate.spec import (
    AblationSpecError,
    Arm,
    Factor,
    Spec,
    canonical,
    err,
    is_int,
    is_name,
    pos_int,
    sha256,
    strict,
)
from k3jax.checkpoint.source import checkpoint_error, default_ckpt, model_config
from k3jax.config import ConfigError
from k3jax.draft.config import target_hash
from k3jax.draft.measure import BUILTIN_DRAFTERS, CATEGORIES, draft_source, prompt_set, tokens_sha256
from k3jax.draft.speculative import ROLLBACKS
from k3jax.errors import InputError

# key -> (type, default)
DECODING = {"draft": (bool, False), "drafter": (str, "shipped"), "draft_tokens": (int, 7), "rollback": (str, "copy"),
            "greedy": (bool, True), "temperature": (float, 1.0), "top_k": (int, 0), "top_p": (float, 1.0)}
DRAFT_ONLY = ("drafter", "draft_tokens", "rollback")
SAMPLING_ONLY = ("temperature", "top_k", "top_p")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class DecodingSpec(Spec):
    """A checked decoding study: a ``Spec`` whose arms (``Arm.flat``: ``decoding.*``, ``model.*``, ``prompts.*``)
    carry no training, plus the model, the prompts and the drafter directories its arms use."""

    model: dict = field(default_factory=dict)  # {"ckpt": dir or None, "preset": name or None, "source", "dtype"}
    prompts: dict = field(default_factory=dict)  # {"categories", "count", "length", "max_new_tokens", "sha256"}
    tokens: dict = field(default_factory=dict, compare=False)  # category -> int32 [count, length] prompts
    drafters: dict = field(default_factory=dict)  # drafter as written -> checked directory (None: random / self)


def decoding_of(arm: Arm) -> dict:
    """The decoding settings of ``arm`` ({key: value} over DECODING)."""
    return {k: arm.flat[f"decoding.{k}"] for k in DECODING}


def inert(d: dict) -> set[str]:
    """The decoding keys without effect under settings ``d``."""
    return (set() if d["draft"] else set(DRAFT_ONLY)) | (set(SAMPLING_ONLY) if d["greedy"] else set())


# ------------------------------------------------------------------------------------------------------ tables

def _value(where: str, v, kind: type):
    if kind is bool:
        if not isinstance(v, bool):
            raise err(where, f"must be true or false, got {v!r}")
    elif kind is int:
        if not is_int(v):
            raise err(where, f"must be an integer, got {v!r}")
    elif kind is float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise err(where, f"must be a number, got {v!r}")
        v = float(v)
    elif not isinstance(v, str) or not v:
        raise err(where, f"must be a non-empty string, got {v!r}")
    return v


def _decoding(table, where: str) -> dict:
    """A ``decoding = {...}`` table as checked values (only the keys given)."""
    strict(table, DECODING, where)
    out = {k: _value(f"{where}.{k}", v, DECODING[k][0]) for k, v in table.items()}
    checks = {"draft_tokens": (lambda x: x >= 1, "must be >= 1"), "rollback": (lambda x: x in ROLLBACKS,
                                                                               f"must be one of {ROLLBACKS}"),
              "temperature": (lambda x: x > 0, "must be > 0"), "top_k": (lambda x: x >= 0, "must be >= 0 (0: off)"),
              "top_p": (lambda x: 0 < x <= 1, "must lie in (0, 1]")}
    for k, v in out.items():
        if k in checks and not checks[k][0](v):
            raise err(f"{where}.{k}", f"{checks[k][1]}, got {v!r}")
    return out


def _model(base: dict, here: str, path: str) -> tuple[dict, object]:
    """({"ckpt", "preset", "source", "dtype"}, the K3Config) of [base]; no weight is read."""
    where = f"{path}: [base]"
    if "ckpt" in base and "preset" in base:
        raise err(where, "give one of `ckpt` (a checkpoint, \"shipped\" by default) or `preset`")
    dtype = base.get("dtype", "float32")
    if dtype not in DTYPES:
        raise err(f"{where} dtype", f"must be one of {DTYPES}, got {dtype!r}")
    if "preset" in base:
        try:
            cfg = model_config(ckpt=None, preset=base["preset"])
        except (ConfigError, InputError) as e:
            raise err(f"{where} preset", str(e)) from e
        return {"ckpt": None, "preset": base["preset"], "source": f"preset:{base['preset']}", "dtype": dtype}, cfg
    src = base.get("ckpt", "shipped")
    if not isinstance(src, str):
        raise err(f"{where} ckpt", f"must be \"shipped\" or a directory, got {src!r}")
    ckpt = default_ckpt() if src == "shipped" else os.path.join(here, src)
    if ckpt is None:
        raise err(f"{where} ckpt", "no shipped k3-mini in this install; name a checkpoint directory")
    if (msg := checkpoint_error(ckpt)) is not None:
        raise err(f"{where} ckpt", msg)
    try:
        cfg = model_config(ckpt=ckpt, preset=None)
    except (ConfigError, InputError) as e:
        raise err(f"{where} ckpt", str(e)) from e
    return {"ckpt": ckpt, "preset": None, "source": src, "dtype": dtype}, cfg


def _prompts(t, path: str) -> dict:
    where = f"{path}: [prompts]"
    strict(t, ("categories", "count", "length", "max_new_tokens"), where)
    cats = t.get("categories", list(CATEGORIES))
    if not isinstance(cats, list) or not cats or any(c not in CATEGORIES for c in cats) or len(set(cats)) != len(cats):
        raise err(f"{where} categories", f"must be a non-empty list of distinct names out of {list(CATEGORIES)}, "
                                         f"got {cats!r}")
    out = {"categories": tuple(cats), "count": pos_int(t.get("count", 8), f"{where} count"),
           "length": pos_int(t.get("length", 64), f"{where} length"),
           "max_new_tokens": pos_int(t.get("max_new_tokens", 64), f"{where} max_new_tokens")}
    if out["length"] < 2:
        raise err(f"{where} length", f"must be >= 2, got {out['length']}")
    return out


# ------------------------------------------------------------------------------------------------- the arms

def _level_errors(fname: str, level: str, base: dict, d: dict, keys, where: str) -> tuple[list[str], str | None]:
    """(errors, the one key it changes or None) of one level's settings ``d`` against the base's."""
    changed = [k for k in DECODING if d[k] != base[k]]
    if len(changed) > 1:
        return [f"{where}: factor {fname!r} level {level!r} differs from the base in {len(changed)} decoding keys "
                f"({', '.join(f'decoding.{k}' for k in changed)}); a decoding arm changes exactly one"], None
    if not changed:
        return [], None
    k = changed[0]
    if keys is not None and f"decoding.{k}" not in keys:
        return [f"{where}: factor {fname!r} level {level!r} changes decoding.{k}, not a declared key "
                f"({', '.join(keys)})"], k
    if k in inert(base) and k in inert(d):
        why = "the draft is off" if k in DRAFT_ONLY else "sampling is greedy"
        return [f"{where}: factor {fname!r} level {level!r} changes nothing in effect: decoding.{k} has no effect "
                f"while {why}"], k
    return [], k


def _factor(t, where: str, base: dict) -> tuple[str, tuple | None, dict]:
    """(name, declared keys or None, {level: settings}) of one [[factor]] table."""
    strict(t, ("name", "keys", "levels"), where)
    name = t.get("name")
    if not is_name(name):
        raise err(where, f"needs a name of letters, digits and '_', got {name!r}")
    where = f"{where} ({name!r})"
    keys = t.get("keys")
    if keys is not None and (not isinstance(keys, list) or not keys
                             or any(not isinstance(k, str) or k.removeprefix("decoding.") not in DECODING
                                    or not k.startswith("decoding.") for k in keys)):
        raise err(f"{where}.keys", f"must be a non-empty list of decoding keys (decoding.<{'|'.join(DECODING)}>), "
                                   f"got {keys!r}")
    levels = t.get("levels")
    if not isinstance(levels, dict) or len(levels) < 2:
        raise err(f"{where}.levels", "must be a table of at least two levels (the base's and another)")
    out = {}
    for lv, lt in levels.items():
        lw = f"{where} level {lv!r}"
        if not is_name(lv):
            raise err(lw, "level names are letters, digits and '_' (they name run directories)")
        strict(lt, ("decoding",), lw)
        out[lv] = base | _decoding(lt.get("decoding", {}), f"{lw}.decoding")
    return name, None if keys is None else tuple(keys), out


def _arm(name, factor, level, cfg, d: dict, common: dict) -> Arm:
    return Arm(name, factor, level, cfg, {}, None, {f"decoding.{k}": d[k] for k in DECODING} | common, {})


def _drafter_dir(d: dict, model: dict, cfg, here: str, where: str) -> str | None:
    src = d["drafter"] if d["drafter"] in BUILTIN_DRAFTERS else os.path.join(here, d["drafter"])
    try:
        return draft_source(src, cfg, ckpt=model["ckpt"], K=d["draft_tokens"], where=where)
    except InputError as e:
        raise AblationSpecError(str(e)) from e


def load_decoding(path: str) -> DecodingSpec:
    """Read, resolve and check the decoding study at ``path`` (module docstring); no weight is read."""
    doc = read_toml(path)
    if file_kind(doc, path) != "decoding":
        raise err(f"{path}: kind", "not a decoding study (kind = \"decoding\")")
    strict(doc, ("kind", "name", "description", "seeds", "base", "prompts", "aa", "factor"), path)
    here = os.path.dirname(os.path.abspath(path))
    if "seeds" not in doc:
        raise err(path, "needs `seeds` (a count or a list: the sampler's seeds)")
    seeds = parse_seeds(doc["seeds"], f"{path}: seeds")
    base_t = strict(doc.get("base", {}), ("ckpt", "preset", "dtype", "decoding"), f"{path}: [base]")
    model, cfg = _model(base_t, here, path)
    base_d = {k: v for k, (_, v) in DECODING.items()} | _decoding(base_t.get("decoding", {}),
                                                                    f"{path}: [base] decoding")
    prompts = _prompts(doc.get("prompts", {}), path)
    aa = strict(doc.get("aa", {}), ("repeat",), f"{path}: [aa]")
    if not isinstance(aa.get("repeat", False), bool):
        raise err(f"{path}: [aa] repeat", f"must be true or false, got {aa['repeat']!r}")
    tables = doc.get("factor", [])
    if not isinstance(tables, list) or not tables:
        raise err(path, "needs at least one [[factor]]")
    try:
        tokens = {c: prompt_set(c, count=prompts["count"], length=prompts["length"], vocab=cfg.vocab_size)
                  for c in prompts["categories"]}
    except InputError as e:
        raise err(f"{path}: [prompts]", str(e)) from e
    prompts["sha256"] = {c: tokens_sha256(t) for c, t in tokens.items()}
    common = ({"model.source": model["source"], "model.dtype": model["dtype"], "model.config_hash": target_hash(cfg)}
              | {f"prompts.{k}": (list(v) if isinstance(v, tuple) else v) for k, v in prompts.items()
                 if k != "sha256"}
              | {f"prompts.sha256.{c}": h for c, h in prompts["sha256"].items()})
    base = _arm("base", None, None, cfg, base_d, common)
    arms, factors, errors, names = {"base": base}, [], [], set()
    for i, t in enumerate(tables):
        fname, keys, levels = _factor(t, f"{path}: factor #{i + 1}", base_d)
        if fname in names:
            raise err(path, f"factor {fname!r} appears twice")
        names.add(fname)
        base_level, level_arms = None, {}
        for lv, d in levels.items():
            errs, key = _level_errors(fname, lv, base_d, d, keys, path)
            errors += errs
            if errs:
                continue
            if key is None:
                if base_level is not None:
                    errors.append(f"{path}: factor {fname!r} level {lv!r} does not change anything: it resolves to "
                                  f"the base, as level {base_level!r} does")
                base_level = lv
                level_arms[lv] = "base"
            else:
                arms[f"{fname}={lv}"] = _arm(f"{fname}={lv}", fname, lv, cfg, d, common)
                level_arms[lv] = f"{fname}={lv}"
        if base_level is None and not errors:
            errors.append(f"{path}: factor {fname!r}: no level resolves to the base; add the base as a level "
                          f"(e.g. `{fname}_base = {{}}`) so each level has its baseline")
        changed = sorted({k.removeprefix("decoding.") for n in level_arms.values() if n != "base"
                          for k in diff(base, arms[n])})
        factors.append(Factor(fname, keys or tuple(f"decoding.{k}" for k in changed), (), (), 0.0, level_arms,
                              base_level or ""))
    if errors:
        raise AblationSpecError("\n".join(errors))
    drafters, checked = {}, set()
    for n, a in arms.items():
        d = decoding_of(a)
        if d["draft"] and (d["drafter"], d["draft_tokens"]) not in checked:   # K against each draft's block size
            checked.add((d["drafter"], d["draft_tokens"]))
            drafters[d["drafter"]] = _drafter_dir(d, model, cfg, here, f"{path}: arm {n!r} decoding.drafter")
    first: dict[str, str] = {}
    arms = {n: dataclasses.replace(a, run_id=first.setdefault(canonical(a.flat), n)) for n, a in arms.items()}
    runs = {a.run_id: arms[a.run_id] for a in arms.values()}
    aa = {"seed_offset": None, "repeat": aa.get("repeat", False)}
    fingerprint = sha256({"kind": "decoding", "seeds": seeds, "aa": aa,
                          "arms": {n: {"flat": a.flat, "run_id": a.run_id} for n, a in arms.items()},
                          "factors": [dataclasses.asdict(f) for f in factors]})
    return DecodingSpec(path=path, name=doc.get("name", os.path.splitext(os.path.basename(path))[0]),
                        description=str(doc.get("description", "")), seeds=seeds, base=arms["base"],
                        factors=tuple(factors), arms=arms, runs=runs, aa=aa, bootstrap=0, output={},
                        fingerprint=fingerprint, model=model, prompts=prompts, tokens=tokens, drafters=drafters)


# ------------------------------------------------------------------------------------------------- --check

def describe_decoding(spec: DecodingSpec) -> str:
    """What `k3 ablate --check` prints for a decoding study: the model, the prompts, every arm's difference."""
    p = spec.prompts
    lines = [f"{spec.path}: decoding study {spec.name!r}, model {spec.model['source']} ({spec.model['dtype']}), "
             f"seeds {list(spec.seeds)}, {len(spec.runs)} distinct configuration(s), fingerprint "
             f"{spec.fingerprint[:12]}",
             f"prompts: {p['count']} x {p['length']} tokens per category ({', '.join(p['categories'])}), "
             f"{p['max_new_tokens']} new tokens per row" + ("; A/A: the base again at every seed"
                                                             if spec.aa["repeat"] else "")]
    for n, a in spec.arms.items():
        same = f" (runs as {a.run_id})" if a.run_id != n else ""
        d = decoding_of(a)
        lines.append(f"{n}{same}: " + ", ".join(f"{k}={d[k]}" for k in DECODING if k not in inert(d)))
        if n != "base":
            lines.append(format_diff(spec.base, a))
    return "\n".join(lines)


def resolved_decoding(spec: DecodingSpec) -> dict:
    """What `k3 ablate --check --json` prints for a decoding study."""
    return {"fingerprint": spec.fingerprint, "kind": "decoding",
            "arms": {n: {"run": a.run_id, "flat": a.flat} for n, a in spec.arms.items()}}


__all__ = ["DECODING", "DRAFT_ONLY", "SAMPLING_ONLY", "DecodingSpec", "decoding_of", "describe_decoding", "inert",
           "load_decoding", "resolved_decoding"]
