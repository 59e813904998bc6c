"""What a step cannot go below, beside the compiled program's own figures: the fixed latency of the collectives it runs
and the bytes it must touch in HBM.

    lat = collective_latency(compiled.as_text(), hints, chip, sizes, dims)  # {"seconds", "count", "by_kind"}
    floor = bytes_floor(cfg, spec, sizes, strategy)                          # bytes per device, by part

``collective_latency``: every collective of the HLO (loops counted as they run, as ``hlo_cost.program_stats``
counts them) costs the chip's launch plus its hops' latency (``hardware.collective_hops`` over the links its group
lies on, ``hardware.axis_links``). A group's mesh axes come from its ``replica_groups`` — the mesh form
(``mesh[...] {'expert'}``), the iota form (``[2,4]<=[8]``) or explicit lists of device ids (partition ids, in the
mesh's row-major order) — or, for a collective-permute, from each source → target pair.

``bytes_floor``: the bytes per device one step reads or writes at the least — the weights, the optimizer state, the
cache and the step's inputs and outputs, each once; activations (saved, recomputed or streamed) are left out, so the
floor is below what any program can do, and ``memory_s / bytes_floor_s`` (``hardware.roofline``) says how much of the
compiled program's traffic is beyond it. Per part, per device (the rules' shardings, ``estimate.estimate_arguments``
and ``estimate.cache_bytes``; a replicated tensor counts on every device):
    weights   serving: every non-expert weight as stored + the routed experts the step's tokens reach: a device's
              experts × (1 - (1 - A/E)^n), the expected share of E experts hit by n tokens' top-A choices (uniform
              routing), n the tokens that reach one device's experts (its own under data parallelism, its expert
              group's under expert parallelism, every row under the small-batch rule); train modes: the same read of
              the master weights (fp32) / frozen base
    optimizer train modes: the gradient written and read, the trainable masters read and written, the optimizer
              state read and written (every trainable leaf: the update touches the experts no token reached too)
    cache     decode: the KDA state and conv tails read and written, the MLA latent's --context keys read and one
              position written; prefill: the KDA state written, T positions of the latent written
    io        the tokens in; the logits out (forward: [B, T, V] f32 split like the batch; prefill / decode: the last
              token's [B, V] f32 on every device)
A verify step (K drafted tokens, a piece of T = K + 1): weights as decode's for the piece's tokens; cache — the KDA
state and conv tails read and written, the latent's --context keys read and T positions written; records — the
verify records written once and what the rollback reads of them (copy: one state of T per row, and the conv inputs;
replay: all of them); draft — its weights once, its context cache's filled positions read and T written; io — the
piece in and the step's outputs (accepted counts, next anchors, drafted ids: the logits never leave the step).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import jax
import numpy as np

from k3jax.config import K3Config
from k3jax.model.cache import capacity
from k3jax.model.counts import is_routed_expert
from k3jax.plan.estimate import cache_bytes, draft_bytes, estimate_arguments, record_bytes
from k3jax.plan.hardware import Chip, axis_links, collective_hops, collective_latency_s, permute_hops
from k3jax.plan.hlo import multiplicities, parse
from k3jax.plan.hlo_cost import COLLECTIVES
from k3jax.plan.spec import CACHED, SERVING, STEP_MODES, PlanSpec, plan_params, run_settings, with_defaults
from k3jax.pytree import key_names
from k3jax.sharding import placement as place
from k3jax.sharding.mesh import axis_sizes
from k3jax.sharding.rules import param_specs

# ---------------------------------------------------------------------------------------------------------------
# collective latency

_MESH_GROUPS = re.compile(r"replica_groups=mesh\[[^\]]*\]\s*\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)?\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def collective_kind(opcode: str) -> str | None:
    """The collective an opcode runs (``all-gather-start`` → ``all-gather``), None for any other (and ``-done``)."""
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES else None


def first_group(attrs: str) -> list[int] | None:
    """Device ids of a collective's first replica group from its attributes (iota or explicit form); None when
    every device is in one group (``replica_groups={}``) or the attributes hold none of these forms."""
    m = _IOTA_GROUPS.search(attrs)
    if m:
        groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(groups, size)[0].tolist()
    m = _LIST_GROUPS.search(attrs)
    if m and m.group(1):
        return [int(x) for x in re.match(r"\{([\d,]*)\}", m.group(1)).group(1).split(",") if x]
    return None


def group_axes(attrs: str, sizes: dict[str, int]) -> dict[str, int]:
    """{mesh axis: positions of it in the group} of a collective over the mesh ``sizes`` (all of MESH_AXES, in
    order): the mesh form names the axes (a sub-axis, ``'expert':(1)2``, counts as its whole axis: more hops, not
    fewer); ids are unravelled in the mesh's row-major order (a group that holds only
    part of an axis gives how many positions it holds); no group stated: every axis."""
    m = _MESH_GROUPS.search(attrs)
    if m:
        names = re.findall(r"'(\w+)'", m.group(1)) or [a for a in sizes if sizes[a] > 1]
        return {a: sizes[a] for a in names if sizes.get(a, 1) > 1}
    ids = first_group(attrs)
    if ids is None:
        return {a: n for a, n in sizes.items() if n > 1}
    if max(ids) >= math.prod(sizes.values()):
        raise ValueError(f"replica group {ids[:8]}... names devices beyond the mesh {sizes}")
    coords = np.unravel_index(np.asarray(ids), tuple(sizes.values()))
    return {a: len(set(c.tolist())) for a, c in zip(sizes, coords, strict=True) if len(set(c.tolist())) > 1}


def instr_hops(kind: str, attrs: str, sizes: dict[str, int], links: dict) -> int:
    """ICI hops of one collective instruction (``hardware.collective_hops``; a permute: its farthest pair)."""
    if kind == "collective-permute":
        m = _PAIRS.search(attrs)
        pairs = [tuple(int(x) for x in p) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(1))] if m else []
        shape = tuple(sizes.values())
        far = 0
        for s, t in pairs:
            cs, ct = np.unravel_index(s, shape), np.unravel_index(t, shape)
            far = max(far, sum(permute_hops(links[a], int(a_s), int(a_t))
                               for a, a_s, a_t in zip(sizes, cs, ct, strict=True) if a_s != a_t))
        return far
    spans = group_axes(attrs, sizes)
    chain = [link for a, n in spans.items() for link in (links[a] if n == sizes[a] else [(n, 1, False)])]
    return collective_hops(kind, chain)


def collective_latency(text: str, hints: dict[str, int] | None, chip: Chip, sizes: dict,
                       dims: tuple[int, ...] | None) -> dict:
    """The fixed latency of every collective a compiled program runs per step (module docstring):
    ``{"seconds", "count", "by_kind": {kind: {"count", "seconds", "max_hops"}}}``. ``sizes``: the plan's mesh
    (``{axis: size}``); ``dims``: the slice's physical axes (``hardware.topology_dims``; None: every mesh axis a
    line)."""
    sizes = axis_sizes(sizes)
    links = axis_links(sizes, dims, chip)
    comps, entry = parse(text)
    mult = multiplicities(comps, entry, hints)[0]
    by_kind: dict = defaultdict(lambda: {"count": 0, "seconds": 0.0, "max_hops": 0})
    for c in comps.values():
        m = mult.get(c.name, 0)
        for ins in c.instrs if m else ():
            kind = collective_kind(ins.opcode)
            if kind is None:
                continue
            hops = instr_hops(kind, ins.attrs, sizes, links)
            row = by_kind[kind]
            row["count"] += m
            row["seconds"] += m * collective_latency_s(chip, hops)
            row["max_hops"] = max(row["max_hops"], hops)
    return {"seconds": sum(r["seconds"] for r in by_kind.values()),
            "count": sum(r["count"] for r in by_kind.values()), "by_kind": dict(sorted(by_kind.items()))}


# ---------------------------------------------------------------------------------------------------------------
# the bytes floor


def experts_reached(tokens: float, num_experts: int, top_k: int) -> float:
    """Expected share of E experts that ``tokens`` tokens' top-A choices reach at least once (uniform routing):
    1 - (1 - A/E)^n."""
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def expert_tokens(spec: PlanSpec, sizes: dict, strategy: str) -> float:
    """Tokens of one step that reach one device's experts: every row where they sit whole on every device
    (``placement.whole_rows``); otherwise the device's own tokens (B·T over the token and sequence axes) times the
    ways the expert exchange gathers them (the expert axis), at most B·T."""
    spec = with_defaults(spec)[0]
    tokens = spec.batch * spec.seq_len
    if spec.mode in STEP_MODES and place.whole_rows(strategy, sizes, spec.batch):
        return float(tokens)
    s = axis_sizes(sizes)
    seq = s["context"] if place.uses_context(strategy, sizes) else 1
    return float(min(tokens, tokens / (place.token_parallel(strategy, sizes) * seq) * s["expert"]))


def routed_expert_elements(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str) -> float:
    """Elements per device of the routed-expert leaves of the mode's parameter tree under the rules' shardings."""
    abstract = plan_params(cfg, spec)
    specs = jax.tree.leaves(param_specs(cfg, strategy, sizes, abstract),
                            is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    s = axis_sizes(sizes)
    total = 0.0
    for (path, leaf), pspec in zip(jax.tree_util.tree_flatten_with_path(abstract)[0], specs, strict=True):
        if is_routed_expert(key_names(path)):
            ways = math.prod(s[a] for ax in pspec if ax for a in ((ax,) if isinstance(ax, str) else ax))
            total += math.prod(leaf.shape) / ways
    return total


def bytes_floor(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str, est: dict | None = None) -> dict:
    """The bytes per device a step of ``spec`` must touch in HBM, by part (module docstring): ``weights``,
    ``optimizer``, ``cache``, ``io``, ``total``, with ``expert_tokens`` (n) and ``experts_reached`` (the share of a
    device's experts they reach). ``est``: ``estimate_arguments`` of the same plan, if the caller has it."""
    spec = with_defaults(spec)[0]
    est = est or estimate_arguments(cfg, spec, sizes, strategy)
    n = expert_tokens(spec, sizes, strategy)
    reach = experts_reached(n, cfg.num_experts, cfg.num_experts_per_token) if cfg.num_experts else 1.0
    if est["packed_experts"]:  # serving, frozen-experts, lora: the routed experts are the packed bytes
        experts, other = est["packed_experts"], est["weights"]
    else:  # train: fp32 masters, the experts among them
        experts = 4 * routed_expert_elements(cfg, spec, sizes, strategy)
        other = est["weights"] - experts
    out = {"expert_tokens": n, "experts_reached": reach, "weights": other + reach * experts,
           # gradient written + read, trainable masters read + written (4 bytes each, as the gradient), state both
           "optimizer": 4 * est["gradient_bytes"] + 2 * est["optimizer"], "cache": 0.0, "io": est["tokens"]}
    if spec.mode in CACHED:
        cache = cache_bytes(cfg, spec, sizes, strategy)
        slots = capacity(cfg, spec.context, run_settings(cfg, spec))
        if spec.mode in STEP_MODES:  # --context keys read, the piece's positions written (decode: 1)
            out["cache"] = 2 * cache["kda_per_device"] + cache["mla_per_device"] * (spec.context + spec.seq_len) / slots
        else:
            out["cache"] = cache["kda_per_device"] + cache["mla_per_device"] * spec.seq_len / slots
        if spec.mode == "verify":
            parts = _verify_parts(cfg, spec, sizes, strategy, slots)
            out["io"] += parts.pop("outputs")
            out.update(parts)
        else:
            out["io"] += 4 * spec.batch * cfg.vocab_size  # the last token's logits, f32, on every device
    elif spec.mode in SERVING:  # forward: [B, T, V] f32, split like the batch (and the sequence)
        s = axis_sizes(sizes)
        seq = s["context"] if place.uses_context(strategy, sizes) else 1
        out["io"] += 4 * spec.batch * spec.seq_len * cfg.vocab_size / (place.token_parallel(strategy, sizes) * seq)
    out["total"] = out["weights"] + out["optimizer"] + out["cache"] + out["io"] + out.get("records", 0.0) + out.get(
        "draft", 0.0)
    return out


def _verify_parts(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str, slots: int) -> dict:
    """A verify step's records, draft and outputs (module docstring), bytes per device."""
    T, K = spec.seq_len, spec.draft_tokens
    rec = record_bytes(cfg, spec, sizes, strategy)["per_device_by_leaf"]
    read = {"rec_state": 1 / T, "rec_x": 1.0} if spec.rollback == "copy" else dict.fromkeys(rec, 1.0)
    d = draft_bytes(cfg, spec, sizes, strategy)
    return {"records": sum(v * (1 + read.get(k, 0.0)) for k, v in rec.items()),
            "draft": d["params_per_device"] + d["cache_per_device"] * (spec.context + T) / slots,
            "outputs": 4 * spec.batch * (K + 2)}  # n, the next anchor and the K drafted ids, on every device

__all__ = ["bytes_floor", "collective_kind", "collective_latency", "expert_tokens", "experts_reached",
           "first_group", "group_axes", "instr_hops", "routed_expert_elements"]
