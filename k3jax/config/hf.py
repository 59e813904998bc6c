"""HF ``config.json`` <-> ``K3Config`` through one table of keys (docs/model.md §1.1, §13; the table:
``k3jax.config.hf_keys``).

``KEYS`` drives both directions: ``from_hf`` parses and validates with it, and ``to_hf_dict`` (the writer's
``config.json``) emits from it, so parse and emit cannot drift. Every key of a text config is in one of three
classes:

- **used** — a row of ``KEYS``: parsed, type-checked and validated. A value that asks for math k3jax does not
  implement (RoPE applied, a softmax router, grouped routing, MTP layers, an unknown ``hidden_act`` or
  ``topk_method``, a quantization other than ``mxfp4-pack-quantized``, ...) is a ``ConfigError`` naming the field
  and the value. A missing key takes the default of transformers' ``KimiLinearConfig`` (the class that reads these
  files), or is an error where that class has no usable default.
- **known, irrelevant to the math** — serialized ``PretrainedConfig`` boilerplate and metadata
  (``BOILERPLATE``: what the release's own files carry, accepted without comment; ``EXTRA_READ`` of them kept in
  ``K3Config.extra``, e.g. ``max_position_embeddings``) and runtime / tokenizer / RoPE settings other writers add
  (``IRRELEVANT``: accepted, listed in the report as ``ignored_keys``). RoPE settings are irrelevant because only
  NoPE MLA (``mla_use_nope: true``) is accepted: nothing is ever rotated.
- **derived** (transformers' form) — what transformers' ``KimiLinearConfig`` derives from the used keys and
  serializes (``DERIVED``: ``layer_types``, ``mlp_layer_types``, ``linear_{num_heads,head_dim,conv_kernel_dim}``,
  ``qk_head_dim``): beside the used keys when it read a release file, alone when it built the config itself (then
  the file has no ``linear_attn_config`` and no ``first_k_dense_replace``). transformers builds its model from them
  *instead of* the used keys (``layer_types`` over ``linear_attn_config``, ``mlp_layer_types`` over
  ``first_k_dense_replace``), so where the file lacks the used key k3jax reads it from its derived key
  (``stands_for``; a value k3jax does not implement, e.g. a ``sliding_attention`` layer or a dense MLP after an MoE
  layer, is a ``ConfigError`` naming the derived key), and where both are present they must agree: a disagreement
  is a ``ConfigError`` naming both keys and both values. Present, they are listed in the report as
  ``derived_keys``; those read in place of a used key as ``transformers_form`` (used key -> derived key).
  ``to_hf_dict`` writes the release's form only.
- **unknown** — anything else: one ``UnknownConfigKeysWarning`` listing every such key with its path
  (``text_config.foo``); ``strict=True`` (``--strict-config``) makes it a ``ConfigError``.

    >>> cfg = from_hf("ckpt/config.json", report=(r := {}))   # doctest: +SKIP
    >>> r["unknown_keys"], r["ignored_keys"], r["derived_keys"], r["transformers_form"]  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from k3jax.config.arch import K3Config
from k3jax.config.checks import ConfigError
from k3jax.config.hf_keys import (
    BOILERPLATE,
    DERIVED,
    EXTRA_READ,
    IRRELEVANT,
    KEY_NAMES,
    KEYS,
    LINEAR_ATTN_KEYS,
    MXFP4_FORMAT,
    REQUIRED,
    STANDS_FOR,
    TOP_USED,
    Derived,
    Key,
)
from k3jax.errors import InputError


class UnknownConfigKeysWarning(UserWarning):
    """A config carries keys k3jax does not know; they were ignored (``strict=True`` refuses them)."""


# ------------------------------------------------------------------------------------------------------- parsing

def _load_json(path_or_dict) -> tuple[dict, str]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, "<dict>"
    p = os.fspath(path_or_dict)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p, encoding="utf-8") as f:
            return json.load(f), p
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None


def classify_keys(raw: dict, tc: dict, where: str) -> tuple[list[str], list[str]]:
    """``(unknown, ignored)`` key paths of a config: ``raw`` the file's top level, ``tc`` its text config
    (the same object for a flat Kimi-Linear file), ``where`` the text config's path prefix. ``ignored`` lists the
    ``IRRELEVANT`` keys only (``BOILERPLATE`` is what the release itself carries)."""
    unknown, ignored = [], []

    def sort(keys, prefix, used):
        for k in keys:
            if k in used or k in BOILERPLATE:
                continue
            (ignored if k in IRRELEVANT else unknown).append(prefix + k)

    if tc is not raw:
        sort(raw, "", TOP_USED)
    sort(tc, where, KEY_NAMES)
    lac = tc.get("linear_attn_config")
    if isinstance(lac, dict):
        sort(lac, f"{where}linear_attn_config.", LINEAR_ATTN_KEYS)
    return unknown, ignored


def _expert_format(qc, err) -> str:
    """``expert_format`` from a ``quantization_config``: absent means BF16 experts."""
    if qc is None:
        return "bf16"
    if not isinstance(qc, dict):
        raise err("quantization_config", f"must be an object, got {qc!r}")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise err("quantization_config.config_groups", f"must be an object, got {groups!r}")
    fmt = qc.get("format")
    for g, spec in groups.items():
        spec = spec or {}
        gfmt = spec.get("format", fmt)
        fmt = fmt or gfmt
        if gfmt != MXFP4_FORMAT:
            raise err(f"quantization_config.config_groups.{g}.format", f"unsupported format {gfmt!r} "
                      f"(only {MXFP4_FORMAT})")
        w = spec.get("weights") or {}
        for k, want in (("num_bits", 4), ("group_size", 32), ("type", "float")):
            if k in w and w[k] != want:
                raise err(f"quantization_config.config_groups.{g}.weights.{k}",
                          f"{MXFP4_FORMAT} needs {want!r}, got {w[k]!r}")
        if spec.get("input_activations") not in (None, {}):
            raise err(f"quantization_config.config_groups.{g}.input_activations",
                      "stored activation quantization is not supported (K3 quantizes only expert weights)")
    if fmt != MXFP4_FORMAT:
        raise err("quantization_config.format", f"unsupported format {fmt!r} (only {MXFP4_FORMAT})")
    return "mxfp4"


def _difference(got, want) -> str:
    """Where two layer lists first differ (empty for scalars)."""
    if not (isinstance(got, list) and isinstance(want, list)):
        return ""
    if len(got) != len(want):
        return f" ({len(got)} entries for {len(want)} layers)"
    i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    return f" (first at index {i}, 1-based layer {i + 1}: {got[i]!r} vs {want[i]!r})"


def _derived_value(tc: dict, d: Derived, err):
    """``tc[d.name]`` type-checked and normalized (the caller checks it is present and not null)."""
    v = tc[d.name]
    ok_type = (isinstance(v, list) and all(isinstance(t, str) for t in v)) if d.types == (list,) else (
        isinstance(v, int) and not isinstance(v, bool))
    if not ok_type:
        want = "a list of strings" if d.types == (list,) else "int"
        raise err(d.name, f"expected {want}, got {v!r}")
    return d.normalize(v)


def check_derived(tc: dict, kw: dict, err) -> list[str]:
    """The ``DERIVED`` keys present in ``tc`` (null means absent, as for transformers); each must equal what the
    K3Config fields ``kw`` parsed from ``tc`` give, else ``err(key, message)`` naming both values. Returns the
    names present."""
    present = []
    for d in DERIVED:
        if tc.get(d.name) is None:
            continue
        v = tc[d.name]
        got, want = _derived_value(tc, d, err), d.value(kw)
        if got != want:
            raise err(d.name, f"{v!r} disagrees with {d.source}, which gives {want!r}{_difference(got, want)}; "
                      f"{d.why}, so the two must agree")
        present.append(d.name)
    return present


def _lookup(tc: dict, name: str):
    if "." in name:
        outer, inner = name.split(".", 1)
        sub = tc.get(outer)
        return (sub[inner], True) if isinstance(sub, dict) and inner in sub else (None, False)
    return (tc[name], True) if name in tc else (None, False)


def _type_ok(v, key: Key) -> bool:
    if v is None:
        return key.nullable
    if isinstance(v, bool) and bool not in key.types:
        return False
    return isinstance(v, key.types)


def from_hf(path_or_dict, *, strict: bool = False, report: dict | None = None, **overrides) -> K3Config:
    """Parse an official K3 ``config.json`` (``kimi_k3`` wrapping ``text_config``) or a flat Kimi-Linear one, in the
    release's form or in transformers' (``layer_types``, ``mlp_layer_types``, ``linear_num_heads``, ... for
    ``linear_attn_config`` and ``first_k_dense_replace``).

    Malformed values, contradictions and unsupported math raise ``ConfigError`` (a ``ValueError``) naming the
    field. Unknown keys warn once (``UnknownConfigKeysWarning``), or raise with ``strict=True``. ``report``, if
    given, is filled with ``unknown_keys``, ``ignored_keys``, ``derived_keys`` and ``transformers_form`` (paths; the
    last two only when the config parses). ``overrides`` replace fields of the result
    (e.g. ``name``); run settings are not config fields (``k3jax.config.RunConfig``).
    """
    raw, src = _load_json(path_or_dict)
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: top level must be a JSON object")
    top_type = raw.get("model_type")
    if top_type == "kimi_k3":
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError(f"{src}: field 'text_config' must be an object for model_type 'kimi_k3'")
        tc, where = raw["text_config"], "text_config."
        if tc.get("model_type", "kimi_linear") != "kimi_linear":
            raise ConfigError(f"{src}: field 'text_config.model_type' must be 'kimi_linear', got {tc['model_type']!r}")
    elif top_type == "kimi_linear":
        tc, where = raw, ""
    else:
        raise ConfigError(f"{src}: field 'model_type' must be 'kimi_k3' or 'kimi_linear', got {top_type!r}")

    def err(fld, msg):
        return ConfigError(f"{src}: field '{where}{fld}': {msg}")

    unknown, ignored = classify_keys(raw, tc, where)
    if report is not None:
        report.update(unknown_keys=unknown, ignored_keys=ignored)
    if unknown:
        listing = ", ".join(unknown)
        if strict:
            raise ConfigError(f"{src}: unknown field(s) {listing} (strict config: remove them, or drop "
                              "--strict-config to ignore them with a warning)")
        # stacklevel 2: the caller of from_hf
        warnings.warn(f"{src}: ignoring {len(unknown)} unknown config key(s): {listing}", UnknownConfigKeysWarning,
                      stacklevel=2)
    # absent: transformers' form, whose derived keys stand for its used keys (and a file with neither names the
    # missing used key)
    if "linear_attn_config" in tc and not isinstance(tc["linear_attn_config"], dict):
        raise err("linear_attn_config", f"expected an object, got {tc['linear_attn_config']!r}")

    kw: dict[str, Any] = {}
    values: dict[str, Any] = {}
    read_from: dict[str, str] = {}
    for key in KEYS:
        v, present = _lookup(tc, key.name)
        d = STANDS_FOR.get(key.name)
        if not present:
            if key.name == "tie_word_embeddings" and "tie_word_embeddings" in raw:
                v, present = raw["tie_word_embeddings"], True
            elif d is not None and tc.get(d.name) is not None:  # transformers' form (num_layers is read first)
                try:
                    v, present = d.read(_derived_value(tc, d, err), kw["num_layers"]), True
                except ValueError as e:
                    raise err(d.name, str(e)) from None
                read_from[where + key.name] = where + d.name
            else:
                v = key.default(tc) if callable(key.default) else key.default
                if v is REQUIRED:
                    raise err(key.name, key.missing)
        if present and not _type_ok(v, key):
            want = "/".join(t.__name__ for t in key.types) + (" or null" if key.nullable else "")
            raise err(key.name, f"expected {want}, got {v!r}")
        if key.accept is not None and not key.accept(v):
            raise err(key.name, f"{key.why}, got {v!r}")
        values[key.name] = v
        if key.field is not None:
            kw[key.field] = key.to_cfg(v)

    L = kw["num_layers"]
    fal, kdl = values["linear_attn_config.full_attn_layers"], values["linear_attn_config.kda_layers"]
    if not all(type(i) is int for i in fal):
        raise err("linear_attn_config.full_attn_layers", "must be a list of 1-based layer indices")
    if kdl is not None:
        if not all(type(i) is int for i in kdl):
            raise err("linear_attn_config.kda_layers", "must be a list of 1-based layer indices")
        if set(fal) & set(kdl):
            raise err("linear_attn_config.kda_layers", f"overlaps full_attn_layers at {sorted(set(fal) & set(kdl))}")
        if sorted(set(fal) | set(kdl)) != list(range(1, L + 1)):
            raise err("linear_attn_config.kda_layers", f"together with full_attn_layers must cover 1..{L} exactly")
    kvh = values["num_key_value_heads"]
    if kvh not in (None, kw["mla_num_heads"]):
        raise err("num_key_value_heads", f"MLA needs num_key_value_heads == num_attention_heads "
                  f"({kw['mla_num_heads']}), got {kvh!r}")
    qc = tc["quantization_config"] if "quantization_config" in tc else raw.get("quantization_config")
    kw["expert_format"] = _expert_format(qc, err)
    kw["name"] = overrides.pop("name", f"hf-{top_type}")
    kw["extra"] = {k: tc[k] for k in EXTRA_READ if type(tc.get(k)) is int}
    file_kw = dict(kw)  # the derived keys restate the file's own values, whatever the overrides
    kw.update(overrides)
    try:
        cfg = K3Config(**kw)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{src}: {e}") from None
    derived = check_derived(tc, file_kw, err)
    if report is not None:
        report["derived_keys"] = [where + k for k in derived]
        report["transformers_form"] = read_from
    return cfg


# ------------------------------------------------------------------------------------------------------ emitting

def to_hf_dict(cfg: K3Config, quantization_config: dict | None = None) -> dict:
    """The HF config dict for ``cfg``'s architecture, from ``KEYS``, in the release's form (no transformers-derived
    keys): a ``kimi_k3`` wrapper for AttnRes configs, else a flat ``kimi_linear`` config.
    ``from_hf(to_hf_dict(cfg))`` has ``cfg``'s architecture."""
    tc: dict[str, Any] = {"model_type": "kimi_linear"}
    for key in KEYS:
        if not key.emit_if(cfg):
            continue
        v = key.emit(cfg) if key.emit is not None else getattr(cfg, key.field)
        if "." in key.name:
            outer, inner = key.name.split(".", 1)
            tc.setdefault(outer, {})[inner] = v
        else:
            tc[key.name] = v
    if cfg.expert_format == "mxfp4":
        if quantization_config is None:
            raise InputError("an MXFP4 config needs its quantization_config block")
        tc["quantization_config"] = quantization_config
    if cfg.uses_attn_res:
        return {"model_type": "kimi_k3", "text_config": tc, "tie_word_embeddings": cfg.tie_word_embeddings}
    return tc


__all__ = ["UnknownConfigKeysWarning", "check_derived", "classify_keys", "from_hf", "to_hf_dict"]
