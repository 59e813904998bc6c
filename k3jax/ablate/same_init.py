"""The shared seed init of an ablation: a parameter that exists with the same shape, and the same kind of init, in
two arms starts from the same values in both.

    plan = sharing_plan(spec.runs)                       # run id -> {leaf path: owner run id}
    write_seed_checkpoint("out/seeds/seed-0.npz", spec.runs, plan, seed=0)    # one file per seed, for every arm
    params = arm_params(spec.runs["kda_gate=softplus"], plan, np.load("out/seeds/seed-0.npz"))   # its state dict

Leaves are addressed in the per-layer view (``k3jax.model.layout.unstack``: ``("layers", 3, "kda", "wq")``,
``("embed",)``), so two arms with different stacked layouts (the KDA:MLA ratio) still share layer l's tensors when
layer l has the same kind in both. The owner of a leaf is the first run (spec order: the base first) that has a leaf
of that path and shape with the same kind of init; the seed checkpoint holds each owner's own init of the leaves it
owns, drawn from ``jax.random.key(seed)``, and every arm reads its leaves from there.

Why not simply the same key: the blocks draw their parameters from one sequential RNG stream, so one extra leaf
(LatentMoE's projections, a softplus gate's A_log draw) shifts every later draw of that arm. And why the "kind" test:
one path can be initialised differently in two arms (KDA's A_log: zeros for the safe gate, log U(1, 16) for the
softplus gate, docs/model.md §4.2), and sharing it would hand one arm the other's init. Each run's init is drawn at two
probe keys: a leaf is constant if the draws agree, random otherwise; two leaves are of the same kind when both are
constant and equal, or both random with means and stds that agree within 6 standard errors.
"""

from __future__ import annotations

import hashlib
import math

import jax
import numpy as np

from k3jax.checkpoint.atomic import staged_file
from k3jax.model import abstract_params, init_params
from k3jax.model.layout import restack, unstack
from k3jax.pytree import key_names

PROBE_SEEDS = (1_000_003, 1_000_033)  # only classify each leaf's init; never a training seed's init


def native_init(arm, seed: int) -> dict[tuple, np.ndarray]:
    """The arm's own random init at ``seed`` as {per-layer-view path: array} (eager: no compile to pay per arm)."""
    view = unstack(init_params(arm.cfg, jax.random.key(seed), arm.run), arm.cfg)
    return {key_names(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(view)[0]}


def _signature(a: np.ndarray, b: np.ndarray) -> tuple:
    if np.array_equal(a, b):
        return ("constant", hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
    x = np.concatenate([a.ravel(), b.ravel()]).astype(np.float64)
    return ("random", float(x.mean()), float(x.std()), int(x.size))


def same_kind(s: tuple, t: tuple) -> bool:
    """Whether two leaf signatures (``_signature``) describe the same kind of init."""
    if s[0] != t[0]:
        return False
    if s[0] == "constant":
        return s[1] == t[1]
    (_, ma, sa, na), (_, mb, sb, nb) = s, t
    se_mean = math.sqrt(sa * sa / na + sb * sb / nb)
    se_std = math.sqrt(sa * sa / (2 * na) + sb * sb / (2 * nb))  # a sample std's standard error is ~ std / sqrt(2n)
    return abs(ma - mb) <= 6 * se_mean + 1e-12 and abs(sa - sb) <= 6 * se_std + 1e-12


def sharing_plan(runs: dict) -> dict[str, dict[tuple, str]]:
    """{run id: {leaf path: owner run id}} for the distinct configurations ``runs`` (in order, the base first)."""
    owners: dict[tuple, list[tuple[tuple, str]]] = {}
    plan = {}
    for rid, arm in runs.items():
        a, b = (native_init(arm, s) for s in PROBE_SEEDS)
        plan[rid] = {}
        for path, x in a.items():
            sig = _signature(x, b[path])
            entries = owners.setdefault((path, x.shape), [])
            owner = next((o for s, o in entries if same_kind(s, sig)), None)
            if owner is None:
                entries.append((sig, rid))
                owner = rid
            plan[rid][path] = owner
    return plan


def _key(owner: str, path: tuple) -> str:
    return owner + "::" + "/".join(str(p) for p in path)


def write_seed_checkpoint(path: str, runs: dict, plan: dict, seed: int) -> None:
    """The seed checkpoint of ``runs`` (the runs at this seed) at ``seed``: every owned leaf once, as an .npz written
    atomically (a temporary file, then a rename)."""
    need: dict[str, set] = {}
    for rid in runs:
        for leaf, owner in plan[rid].items():
            need.setdefault(owner, set()).add(leaf)
    arrays = {}
    for owner, leaves in need.items():
        own = native_init(runs[owner], seed)
        arrays |= {_key(owner, leaf): own[leaf] for leaf in leaves}
    with staged_file(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


def arm_params(arm, plan: dict, ckpt) -> dict:
    """The initial state dict of ``arm`` (its run's leaves read from the seed checkpoint ``ckpt``: an ``np.load``
    of ``write_seed_checkpoint``'s file), in the dtype of its run settings."""
    own = plan[arm.run_id]
    abstract = abstract_params(arm.cfg, arm.run)

    def leaf(p, sds):
        x = ckpt[_key(own[key_names(p)], key_names(p))]
        if x.shape != sds.shape:
            raise RuntimeError(f"seed checkpoint: {key_names(p)} has shape {x.shape}, the arm needs {sds.shape}")
        return x.astype(sds.dtype)

    view = jax.tree_util.tree_map_with_path(leaf, unstack(abstract, arm.cfg))
    params = restack(view, arm.cfg)
    if jax.tree.structure(params) != jax.tree.structure(abstract):
        raise RuntimeError(f"seed checkpoint: the restacked tree of {arm.name} does not match its parameter tree")
    return params


def init_summary(runs: dict, plan: dict, arm) -> dict:
    """{"params", "from_base", "own"}: how many of ``arm``'s parameters start from the base's values, and how many
    from its own init (the rest come from another arm's)."""
    view = unstack(abstract_params(arm.cfg, arm.run), arm.cfg)
    sizes = {key_names(p): math.prod(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(view)[0]}
    own = plan[arm.run_id]
    n = sum(sizes.values())
    from_base = sum(sz for p, sz in sizes.items() if own[p] == "base")
    mine = sum(sz for p, sz in sizes.items() if own[p] == arm.run_id)
    return {"params": n, "from_base": from_base, "own": mine if arm.run_id != "base" else 0,
            "own_leaves": sorted("/".join(map(str, p)) for p in sizes if own[p] == arm.run_id and arm.run_id != "base")}


__all__ = ["PROBE_SEEDS", "arm_params", "init_summary", "native_init", "same_kind", "sharing_plan",
           "write_seed_checkpoint"]
