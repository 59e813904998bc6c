"""Validate an opened checkpoint against the name map for a config and plan the load (docs/checkpoint.md §11.8).

``plan_load`` checks every name, shape and dtype against ``name_map.hf_tensors`` for the config before a single data
byte is read, and returns the ``Plan``: each k3jax leaf path with its checkpoint tensors. Other writers' forms are
accepted where they convert losslessly: a floating tensor in another float dtype (cast on load), ``A_log`` in any
vector form with an exactly-zero tail (``a_log_form``), a dense MLP named ``block_sparse_moe.{gate,up,down}_proj``
as transformers 5's ``save_pretrained`` writes it (docs/model.md §13; ``dense_mlp_names``, decided per layer by
presence).

    ck = open_checkpoint("ckpt/")
    plan = plan_load(ck, cfg)                   # raises CheckpointError naming file and tensor
    plan.leaves[("final_norm",)]                # [(TensorSpec, TensorEntry)]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.container import EXPERT_TENSOR_RE, TensorEntry
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.io import Checkpoint
from k3jax.errors import InputError

# Floating dtypes a tensor may be stored in instead of the layout's own: cast on load (never reinterpreted).
# Integer, bool and float8 storage must match exactly (float8 without scales is a quantization, not a dtype).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
A_LOG_TRANSFORMS = ("a_log_pad", "a_log_4d")
# A dense MLP tensor as the release names it: (layer prefix, layer, "{gate,up,down}_proj.weight").
DENSE_MLP_RE = re.compile(r"^(.*\bmodel\.layers\.(\d+)\.)mlp\.((?:gate|up|down)_proj\.weight)$")
# transformers 5.x ``save_pretrained`` reverts its ``.block_sparse_moe. -> .mlp.`` load rename on every layer, so a
# dense layer's MLP is stored under the MoE block's name (docs/model.md §13: accept both, decided by presence).
DENSE_MLP_ALT = "block_sparse_moe"


@dataclass
class Plan:
    """The validated mapping: k3jax leaf path → its checkpoint tensors (TensorSpec, TensorEntry) pairs.

    ``casts`` counts tensors stored in another float dtype than the layout's (``{"F32->BF16": 190}``: stored F32
    where the release has BF16); they are cast on load, never reinterpreted. ``a_log_forms`` counts the stored
    shapes of ``A_log`` that differ from the layout's own (``{"[H]": 3}``). ``renamed`` maps a release name to the
    name the tensor is stored under where another writer's naming was accepted (the specs in ``leaves`` carry the
    stored name).
    """

    cfg: object
    layout: str
    leaves: dict[tuple, list[tuple[object, TensorEntry]]]  # path -> [(spec, entry)], experts in numeric order
    packed: dict[tuple, bool]  # expert leaf path -> stored MXFP4?
    casts: dict[str, int] = field(default_factory=dict)
    a_log_forms: dict[str, int] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)

    def entries(self, path) -> list[TensorEntry]:
        return [e for _, e in self.leaves[path]]

    def tolerated(self, config_report: dict | None = None) -> dict:
        """What was accepted that the release itself does not contain: ``unknown_keys`` and ``ignored_keys`` of
        the config (from ``from_hf(..., report=)``), ``casts`` and ``a_log_form`` (one name, or a sorted list if
        the layers differ; absent when A_log is stored as the layout stores it). Absent unless something was:
        ``derived_keys`` (config keys transformers derives, checked to agree) and ``dense_mlp_names``
        (``{"block_sparse_moe": [layers]}``: dense MLPs stored under the MoE block's name)."""
        r = config_report or {}
        out = {"unknown_keys": list(r.get("unknown_keys", ())), "ignored_keys": list(r.get("ignored_keys", ())),
               "casts": dict(sorted(self.casts.items()))}
        if r.get("derived_keys"):
            out["derived_keys"] = list(r["derived_keys"])
        if self.a_log_forms:
            forms = sorted(self.a_log_forms)
            out["a_log_form"] = forms[0] if len(forms) == 1 else forms
        layers = sorted({int(DENSE_MLP_RE.match(n).group(2)) for n in self.renamed if DENSE_MLP_RE.match(n)})
        if layers:
            out["dense_mlp_names"] = {DENSE_MLP_ALT: layers}
        return out


def a_log_form(stored: tuple, cfg) -> str | None:
    """Name of an accepted other storage of ``A_log`` (docs/model.md §2.1), or None if ``stored`` is not one: a vector
    of N >= H values (one non-unit axis, e.g. [H], [1, 1, H, 1], [128]) whose tail past H must be exactly 0."""
    H = cfg.kda_num_heads
    big = [n for n in stored if n != 1]
    N = math.prod(stored)
    if len(big) > 1 or N < H:
        return None
    if stored == (H,):
        return "[H]"
    if stored == (1, 1, H, 1):
        return "[1, 1, H, 1]"
    return f"{list(stored)} zero-padded" if N > H else f"{list(stored)}"


def _expected_specs(ck: Checkpoint, cfg, layout) -> list:
    """Name-map specs with the expert storage decided per module by the presence of ``weight_packed``."""
    packed_mods = {n[: -len(".weight_packed")] for n in ck.tensors if n.endswith(".weight_packed")}
    has_dense_expert = any(n.endswith(".weight") and ".experts." in n and EXPERT_TENSOR_RE.match(n)
                           for n in ck.tensors)
    lists = []
    if packed_mods or not has_dense_expert:
        try:
            lists.append(("mxfp4", nm.hf_tensors(cfg, layout, "mxfp4")))
        except InputError as e:  # expert width not a multiple of 32: it cannot be MXFP4
            if packed_mods:
                raise CheckpointError(f"packed experts present but {e}", file=ck.path) from None
    if has_dense_expert or not lists:
        lists.append(("bf16", nm.hf_tensors(cfg, layout, "bf16")))
    if len(lists) == 1:
        return lists[0][1]
    out = [s for s in lists[0][1] if s.transform != "mxfp4"]
    out += [s for s in lists[0][1] if s.transform == "mxfp4" and s.name.rsplit(".", 1)[0] in packed_mods]
    out += [s for s in lists[1][1] if s.transform == "expert" and s.name.rsplit(".", 1)[0] not in packed_mods]
    return out


def _dense_mlp_names(ck: Checkpoint, specs: list) -> tuple[list, dict[str, str]]:
    """``specs`` with each dense layer's MLP under the name it is stored by, and ``{release name: stored name}``.

    Per layer: the release's ``mlp.{gate,up,down}_proj.weight`` unless none of them is present and some
    ``block_sparse_moe.{gate,up,down}_proj.weight`` is (then all three are expected there, so a missing one is
    reported under that name). Both forms in one layer, even split across its three tensors, is an error naming
    the layer: which to load would be a guess.
    """
    alt_of: dict[int, dict[str, str]] = {}
    for s in specs:
        m = DENSE_MLP_RE.match(s.name)
        if m:
            alt_of.setdefault(int(m.group(2)), {})[s.name] = f"{m.group(1)}{DENSE_MLP_ALT}.{m.group(3)}"
    renamed: dict[str, str] = {}
    for layer, alts in sorted(alt_of.items()):
        rel = [n for n in alts if n in ck.tensors]
        alt = [a for a in alts.values() if a in ck.tensors]
        if rel and alt:
            both = any(alts[n] in ck.tensors for n in rel)
            raise CheckpointError(
                f"layer {layer}'s dense MLP is stored {'twice' if both else 'under two namings'}: "
                f"{_examples(rel, lambda n: f' in {ck.tensors[n].file}')} and "
                f"{_examples(alt, lambda n: f' in {ck.tensors[n].file}')}; store its gate/up/down_proj once each, "
                f"all as mlp.* (the release) or all as {DENSE_MLP_ALT}.* (transformers 5)", file=ck.path)
        if alt:
            renamed.update(alts)
    if not renamed:
        return specs, renamed
    return [s._replace(name=renamed[s.name]) if s.name in renamed else s for s in specs], renamed


def _examples(names: Iterable[str], where, k: int = 3) -> str:
    names = list(names)
    shown = ", ".join(f"{n!r}{where(n)}" for n in names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")


def _check_names(ck: Checkpoint, cfg, layout: str, specs: list) -> None:
    """Raise listing missing and unexpected tensors (with their files) unless the names match exactly."""
    expected = {s.name: s for s in specs}
    missing = [n for n in expected if n not in ck.tensors]
    extra = [n for n in ck.tensors if n not in expected]
    if not (missing or extra):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensor(s) missing: " + _examples(
            missing, lambda n: f" (expected in {nm.shard_file_of(n, cfg, layout)})"))
    if extra:
        stray_packed = [n for n in extra if n.endswith(".weight_packed") and not EXPERT_TENSOR_RE.match(n)]
        note = "; only routed experts may be stored MXFP4" if stray_packed else ""
        parts.append(f"{len(extra)} unexpected tensor(s): " + _examples(
            extra, lambda n: f" in {ck.tensors[n].file}") + note)
    raise CheckpointError(f"does not match config {getattr(cfg, 'name', '?')!r} ({layout} layout): "
                          + "; ".join(parts), file=ck.path)


def _check_entry(s, e: TensorEntry, cfg, layout: str, casts: dict, a_log_forms: dict):
    """The spec ``s`` as ``e`` is read (A_log's stored form); dtype and shape checked, casts and forms counted."""
    if e.dtype != s.dtype:
        if not (s.dtype in FLOAT_DTYPES and e.dtype in FLOAT_DTYPES):
            want = f"a float dtype ({s.dtype} in the {layout} layout)" if s.dtype in FLOAT_DTYPES else s.dtype
            raise CheckpointError(f"dtype {e.dtype}, expected {want} for config {cfg.name!r}", file=e.file,
                                  tensor=s.name)
        casts[f"{e.dtype}->{s.dtype}"] = casts.get(f"{e.dtype}->{s.dtype}", 0) + 1
    if s.transform in A_LOG_TRANSFORMS and e.shape != tuple(s.shape):
        form = a_log_form(e.shape, cfg)
        if form is None:
            raise CheckpointError(f"shape {list(e.shape)}, expected {list(s.shape)} for config {cfg.name!r} "
                                  f"(A_log may also be stored [H], [1, 1, H, 1] or zero-padded [N >= H], "
                                  f"H = {cfg.kda_num_heads})", file=e.file, tensor=s.name)
        a_log_forms[form] = a_log_forms.get(form, 0) + 1
        return s._replace(shape=tuple(e.shape), transform="a_log_pad")  # flattened, tail checked on read
    if e.shape != tuple(s.shape):
        raise CheckpointError(f"shape {list(e.shape)}, expected {list(s.shape)} for config {cfg.name!r}",
                              file=e.file, tensor=s.name)
    return s


def _order_experts(ck: Checkpoint, leaves: dict, packed: dict) -> None:
    """Expert leaves in numeric expert order (disk order is string order), packed before scale; one storage each."""
    for path, lst in leaves.items():
        if path in packed:
            lst.sort(key=lambda se: (se[0].expert, se[0].part != "packed"))
            kinds = {se[0].transform for se in lst}
            if len(kinds) > 1:
                raise CheckpointError(f"experts of {'/'.join(map(str, path))} are partly MXFP4 and partly BF16; "
                                      "one leaf must use one storage", file=ck.path)


def plan_load(ck: Checkpoint, cfg, layout: str | None = None) -> Plan:
    """Check names, shapes and dtypes against the name map for ``cfg`` before any data is read; the load Plan.

    Raises CheckpointError listing missing / extra tensors (with their files) or the first shape / dtype mismatch.
    """
    layout = layout or nm.default_layout(cfg)
    specs, renamed = _dense_mlp_names(ck, _expected_specs(ck, cfg, layout))
    _check_names(ck, cfg, layout, specs)
    leaves: dict[tuple, list] = {}
    packed: dict[tuple, bool] = {}
    casts: dict[str, int] = {}
    a_log_forms: dict[str, int] = {}
    for s in specs:
        e = ck.tensors[s.name]
        s = _check_entry(s, e, cfg, layout, casts, a_log_forms)
        leaves.setdefault(s.path, []).append((s, e))
        if s.transform in ("mxfp4", "expert"):
            packed[s.path] = s.transform == "mxfp4"
    _order_experts(ck, leaves, packed)
    return Plan(cfg, layout, leaves, packed, casts, a_log_forms, renamed)


__all__ = ["A_LOG_TRANSFORMS", "DENSE_MLP_ALT", "DENSE_MLP_RE", "FLOAT_DTYPES", "Plan", "a_log_form", "plan_load"]
