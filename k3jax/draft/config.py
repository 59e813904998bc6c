"""The DSpark draft's configuration (``DraftConfig``): what its ``config.json`` says, its HF form, and the check that
a draft belongs to a target.

    dcfg = DraftConfig.for_target(cfg)                       # a small draft for a K3Config, taps over its depth
    json.dump(dcfg.to_hf(), f)                               # model_type "k3_dspark"
    dcfg = DraftConfig.from_hf(json.load(f), source=path)    # strict on the math; other keys land in dcfg.extra
    check_target(dcfg, cfg)                                  # DraftMismatchError naming the field

The draft is dense: ``num_hidden_layers`` pre-norm layers of a DeepSeek-V3-style MLA WITH rotary positions (YaRN,
k3jax/ops/rope.py) and no output gate, each followed by a GLU MLP. Its inputs are the target's hidden states at
``target_layer_ids`` (0-based layers; their concatenation is projected to the draft width) and the target's own
embedding and lm_head, so its width equals the target's and its vocabulary is the target's.

``target_config_hash`` ties a draft to the target architecture it was trained for (``target_hash``); a draft from
elsewhere (an official checkpoint) has none and is checked on the shape fields only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from k3jax.config import K3Config, architecture
from k3jax.config.checks import ConfigError, positive_int
from k3jax.errors import InputError
from k3jax.ops.rope import YarnScaling

MODEL_TYPE = "k3_dspark"
ARCHITECTURE = "K3DSparkModel"
# The published K3 draft's YaRN (its config's rope_scaling) and rope base: every draft k3jax builds uses them.
K3_DRAFT_YARN = YarnScaling(factor=32.0, original_max_position_embeddings=32768, beta_fast=32.0, beta_slow=1.0,
                            mscale=1.0, mscale_all_dim=1.0)
K3_DRAFT_ROPE_THETA = 50000.0
# Where the published draft taps its 93-layer target, as fractions of the depth (0-based layers 2, 23, 47, 71, 89).
_K3_TAPS = (2, 23, 47, 71, 89)
_K3_DEPTH = 92

# Keys that ask for math this draft does not implement: (key, the one accepted value). A config with another value
# is refused naming the key (a silent mismatch would load and draft noise).
_FIXED = {
    "markov_head_type": "vanilla",       # the rank-r bigram head W2 @ W1[prev]
    "mla_use_output_gate": False,        # no g_proj in the draft
    "mla_use_nope": False,               # the draft rotates its rope slice
    "fc_norm": False,                    # no per-tap norm before context_proj
    "aux_hidden_stream": "prefix",       # taps = the residual stream value (target's ``extend(..., taps=)``)
    "tie_word_embeddings": False,        # the target's lm_head, never the embedding
}
# Serialization boilerplate accepted without comment (not kept).
_BOILERPLATE = ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version")
_ROPE_TYPES = ("yarn", "deepseek_yarn")


class DraftMismatchError(InputError):
    """A draft used with a target it was not made for; the message names the field that differs."""


def target_hash(cfg: K3Config) -> str:
    """sha256 of the target's architecture (``k3jax.config.architecture``: the fields a config.json carries, the
    storage format of its experts aside), so a target loaded from disk hashes as the preset it was trained as."""
    arch = architecture(cfg)
    arch.pop("expert_format")
    return hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()


def spread_taps(num_layers: int, num_taps: int) -> tuple[int, ...]:
    """``num_taps`` distinct 0-based layers over a depth of ``num_layers``, placed as the published draft places its
    five over K3's 93 (that exact list for 93 layers and 5 taps; other counts evenly between the same ends)."""
    if not 0 < num_taps <= num_layers:
        raise ConfigError(f"num_taps {num_taps}: must be in [1, {num_layers}] for a {num_layers}-layer target")
    if num_taps == 5:
        fracs = [t / _K3_DEPTH for t in _K3_TAPS]
    else:
        lo, hi = _K3_TAPS[0] / _K3_DEPTH, _K3_TAPS[-1] / _K3_DEPTH
        fracs = [lo + (hi - lo) * i / max(num_taps - 1, 1) for i in range(num_taps)]
    taps = sorted({min(int(round(f * (num_layers - 1))), num_layers - 1) for f in fracs})
    free = [l for l in range(num_layers) if l not in taps]
    while len(taps) < num_taps:  # shallow targets: collisions replaced by the deepest free layers
        taps = sorted(taps + [free.pop()])
    return tuple(taps)


@dataclass(frozen=True)
class DraftConfig:
    """Hyper-parameters of a DSpark draft (HF ``model_type: "k3_dspark"``; field names are the HF keys)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    target_num_hidden_layers: int
    mask_token_id: int
    markov_rank: int = 256
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    rope_theta: float = K3_DRAFT_ROPE_THETA
    rope_scaling: YarnScaling | None = K3_DRAFT_YARN
    max_position_embeddings: int = 1048576
    block_size: int = 7  # K: tokens drafted per block (the block is K + 1 wide with its anchor)
    target_config_hash: str | None = None
    # keys of the config.json this was read from that k3jax does not use (never compared or hashed)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        validate(self)

    @property
    def num_target_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def confidence_width(self) -> int:
        """Inputs of the confidence head: the slot's hidden state, and W1[prev] with ``confidence_head_with_markov``."""
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    def replace(self, **kw) -> DraftConfig:
        return dataclasses.replace(self, **kw)

    @classmethod
    def for_target(cls, cfg: K3Config, *, num_layers: int | None = None, num_taps: int | None = None,
                   num_heads: int | None = None, intermediate_size: int | None = None,
                   markov_rank: int | None = None, mask_token_id: int | None = None, block_size: int = 7,
                   target_layer_ids: tuple[int, ...] | None = None, **overrides) -> DraftConfig:
        """A draft for ``cfg``, scaled from it as the published draft is from K3: layers 5/93 of the target's
        (at least 1), 5 taps spread over the depth (fewer for shallower targets), 2/3 of its MLA heads, MLP hidden
        2 x the width, Markov rank width/28 (at least 8), the target's MLA ranks and head dims, mask token
        vocab_size - 3 (K3's reserved id 163837), the published YaRN. ``overrides``: any other field."""
        L, D = cfg.num_layers, cfg.hidden_size
        taps = tuple(target_layer_ids) if target_layer_ids is not None else spread_taps(
            L, num_taps if num_taps is not None else min(5, L))
        return cls(
            hidden_size=D,
            intermediate_size=intermediate_size or 2 * D,
            num_hidden_layers=num_layers or max(1, round(5 * L / 93)),
            num_attention_heads=num_heads or max(1, (2 * cfg.mla_num_heads) // 3),
            q_lora_rank=overrides.pop("q_lora_rank", None) or cfg.q_lora_rank or max(1, D // 4),
            kv_lora_rank=overrides.pop("kv_lora_rank", cfg.kv_lora_rank),
            qk_nope_head_dim=overrides.pop("qk_nope_head_dim", cfg.qk_nope_head_dim),
            qk_rope_head_dim=overrides.pop("qk_rope_head_dim", cfg.qk_rope_head_dim),
            v_head_dim=overrides.pop("v_head_dim", cfg.v_head_dim),
            vocab_size=cfg.vocab_size,
            target_layer_ids=taps,
            target_hidden_size=D,
            target_num_hidden_layers=L,
            mask_token_id=cfg.vocab_size - 3 if mask_token_id is None else mask_token_id,
            markov_rank=markov_rank or max(8, D // 28),
            block_size=block_size,
            target_config_hash=target_hash(cfg),
            **overrides,
        )

    # ------------------------------------------------------------------------------------------------- HF form
    def to_hf(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """The ``config.json`` dict (the published draft's keys, plus ``block_size`` and ``target_config_hash``)."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("extra", "rope_scaling")}
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["rope_scaling"] = None if self.rope_scaling is None else {
            "type": "yarn", "rope_type": "yarn", **self.rope_scaling._asdict()}
        d.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, num_key_value_heads=self.num_attention_heads,
                 draft_vocab_size=self.vocab_size, num_target_layers=self.num_target_layers,
                 torch_dtype=torch_dtype, **_FIXED)
        return dict(sorted(d.items()))

    @classmethod
    def from_hf(cls, d: dict[str, Any], *, source: str = "config.json",
                report: dict | None = None) -> DraftConfig:
        """Parse a draft's ``config.json`` dict: every math key checked (an InputError naming ``source`` and the
        key), unknown keys kept in ``extra`` (and listed in ``report["extra_keys"]`` when a dict is given)."""
        if not isinstance(d, dict):
            raise InputError(f"{source}: must hold a JSON object")

        def bad(key, msg):
            return InputError(f"{source}: {key} {d.get(key)!r}: {msg}")

        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise bad("model_type", f"not a DSpark draft (expected {MODEL_TYPE!r})")
        for key, want in _FIXED.items():
            if key in d and d[key] != want:
                raise bad(key, f"k3jax's draft implements only {want!r}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"extra", "rope_scaling", "target_layer_ids"}
        kw = {k: d[k] for k in fields if k in d and d[k] is not None}
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size",
                    "target_hidden_size", "target_num_hidden_layers", "mask_token_id", "target_layer_ids"):
            if d.get(key) is None:
                raise bad(key, "required")
        taps = d["target_layer_ids"]
        if not isinstance(taps, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in taps):
            raise bad("target_layer_ids", "must be a list of integers")
        kw["target_layer_ids"] = tuple(taps)
        if isinstance(kw.get("rms_norm_eps"), int) and not isinstance(kw["rms_norm_eps"], bool):
            kw["rms_norm_eps"] = float(kw["rms_norm_eps"])
        for key, want in (("num_target_layers", len(taps)), ("num_key_value_heads", d["num_attention_heads"]),
                          ("draft_vocab_size", d["vocab_size"])):
            if key in d and d[key] != want:
                raise bad(key, f"must be {want} (k3jax's draft has no {key} of its own)")
        kw["rope_theta"], kw["rope_scaling"] = _rope(d, bad)
        known = fields | set(_FIXED) | set(_BOILERPLATE) | {
            "rope_scaling", "rope_parameters", "target_layer_ids", "num_target_layers", "num_key_value_heads",
            "draft_vocab_size"}
        extra = {k: v for k, v in d.items() if k not in known}
        if report is not None:
            report["extra_keys"] = sorted(extra)
        try:
            return cls(**kw, extra=extra)
        except ConfigError as e:
            raise InputError(f"{source}: {e}") from None


def _rope(d: dict, bad) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN or None) from ``rope_scaling`` or transformers' newer ``rope_parameters`` spelling (whose
    rope_theta wins over the top-level key); a rope type other than YaRN / default is refused."""
    spellings = [(k, d[k]) for k in ("rope_scaling", "rope_parameters") if d.get(k) is not None]
    theta = d.get("rope_theta", K3_DRAFT_ROPE_THETA)
    scaling = None
    for key, rs in spellings:
        if not isinstance(rs, dict):
            raise bad(key, "must be an object")
        theta = rs.get("rope_theta", theta)
        kind = str(rs.get("rope_type", rs.get("type", "default"))).lower()
        if kind == "default":
            got = None
        elif kind in _ROPE_TYPES:
            if "factor" not in rs or "original_max_position_embeddings" not in rs:
                raise bad(key, "YaRN needs factor and original_max_position_embeddings")
            names = YarnScaling._fields
            got = YarnScaling(**{k: rs[k] for k in names if k in rs})
            got = got._replace(factor=float(got.factor), beta_fast=float(got.beta_fast),
                               beta_slow=float(got.beta_slow), mscale=float(got.mscale),
                               mscale_all_dim=float(got.mscale_all_dim))
        else:
            raise bad(key, f"rope type {kind!r}: k3jax's draft implements 'default' and YaRN {_ROPE_TYPES}")
        if scaling is not None and scaling != got:
            raise bad(key, "disagrees with rope_scaling")
        scaling = got
    if not isinstance(theta, int | float) or isinstance(theta, bool):
        raise bad("rope_theta", "must be a number")
    return float(theta), scaling


def validate(c: DraftConfig) -> None:
    """Raise ConfigError naming the field for any malformed or contradictory value."""

    def need(cond: bool, fld: str, msg: str):
        if not cond:
            raise ConfigError(f"draft config field {fld!r}: {msg} (got {getattr(c, fld, None)!r})")

    for fld in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size",
                "target_hidden_size", "target_num_hidden_layers", "markov_rank", "block_size",
                "max_position_embeddings"):
        need(positive_int(getattr(c, fld)), fld, "must be a positive integer")
    need(c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even (rotated in pairs)")
    need(c.hidden_size == c.target_hidden_size, "hidden_size",
         f"must equal target_hidden_size {c.target_hidden_size} (the draft reads the target's embedding and head)")
    taps = c.target_layer_ids
    need(len(taps) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in taps), "target_layer_ids",
         "must be a non-empty list of integers")
    need(list(taps) == sorted(set(taps)), "target_layer_ids", "must be ascending and distinct (the concat order)")
    need(0 <= taps[0] and taps[-1] < c.target_num_hidden_layers, "target_layer_ids",
         f"0-based layers must lie in [0, {c.target_num_hidden_layers})")
    need(isinstance(c.mask_token_id, int) and 0 <= c.mask_token_id < c.vocab_size, "mask_token_id",
         f"must be a token id in [0, {c.vocab_size})")
    for fld in ("enable_confidence_head", "confidence_head_with_markov"):
        need(isinstance(getattr(c, fld), bool), fld, "must be true or false")
    need(c.hidden_act in ("silu", "situ"), "hidden_act", "must be 'silu' or 'situ'")
    need(isinstance(c.rms_norm_eps, float) and c.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
    need(c.rope_theta > 1, "rope_theta", "must be > 1")
    rs = c.rope_scaling
    need(rs is None or (isinstance(rs, YarnScaling) and rs.factor >= 1 and positive_int(
        rs.original_max_position_embeddings) and rs.beta_fast > rs.beta_slow > 0), "rope_scaling",
         "YaRN needs factor >= 1, a positive original_max_position_embeddings and beta_fast > beta_slow > 0")
    need(c.target_config_hash is None or (isinstance(c.target_config_hash, str) and len(c.target_config_hash) == 64),
         "target_config_hash", "must be a sha256 hex digest or null")


def check_target(dcfg: DraftConfig, cfg: K3Config) -> None:
    """Raise DraftMismatchError naming the field unless ``dcfg`` is a draft for the target ``cfg``."""
    for fld, mine, theirs, what in (("target_hidden_size", dcfg.target_hidden_size, cfg.hidden_size, "hidden_size"),
                                    ("vocab_size", dcfg.vocab_size, cfg.vocab_size, "vocab_size")):
        if mine != theirs:
            raise DraftMismatchError(f"draft {fld} {mine} != the target's {what} {theirs}")
    if dcfg.target_layer_ids[-1] >= cfg.num_layers:
        raise DraftMismatchError(f"draft target_layer_ids {list(dcfg.target_layer_ids)}: layer "
                                 f"{dcfg.target_layer_ids[-1]} is beyond the target's {cfg.num_layers} layers")
    if dcfg.target_num_hidden_layers != cfg.num_layers:
        raise DraftMismatchError(f"draft target_num_hidden_layers {dcfg.target_num_hidden_layers} != the target's "
                                 f"{cfg.num_layers} layers")
    if dcfg.target_config_hash is not None and dcfg.target_config_hash != target_hash(cfg):
        raise DraftMismatchError(f"draft target_config_hash {dcfg.target_config_hash[:12]}... is not the target's "
                                 f"{target_hash(cfg)[:12]}... (the draft was trained for another architecture)")


__all__ = ["ARCHITECTURE", "K3_DRAFT_ROPE_THETA", "K3_DRAFT_YARN", "MODEL_TYPE", "DraftConfig", "DraftMismatchError",
           "check_target", "spread_taps", "target_hash", "validate"]
