"""HBM bytes of the owner Muon's update over kimi-k3's routed-expert stacks alone, on v5p-512 (fsdp 8 x expert 64),
compiled by the deviceless TPU compiler and read by the plan's byte reader — the optimizer without the rest of the
step, with or without the train step's ``lax.cond`` on a finite gradient norm around it (``--cond``).

    JAX_PLATFORMS=cpu .venv/bin/python experiments/owner_muon_bytes.py [--cond] [--hlo-out PATH]

Session 29 (experiments/LOG.md) ran it on the code before and after the per-group widening of bf16 momentum
(PYTHONPATH at a worktree of each): alone the per-group form was the cheaper, inside the full step it was not.
Needs libtpu (one libtpu process at a time).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.config import get_preset
from k3jax.model import abstract_params
from k3jax.optim.optimizer import OptimConfig, make_optimizer
from k3jax.plan.hlo_cost import program_stats
from k3jax.sharding.mesh import make_mesh
from k3jax.sharding.rules import param_specs

SIZES = {"data": 1, "fsdp": 8, "expert": 64, "context": 1, "tensor": 1}


def experts_only(tree, path=()):
    if isinstance(tree, dict):
        out = {k: experts_only(v, path + (k,)) for k, v in tree.items()}
        return {k: v for k, v in out.items() if v is not None and v != {}}
    return tree if "experts" in path else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cond", action="store_true", help="inside the train step's lax.cond on a finite gradient norm")
    ap.add_argument("--hlo-out", default=None)
    args = ap.parse_args()
    cfg = get_preset("kimi-k3")
    p = experts_only(abstract_params(cfg))
    devs = list(topologies.get_topology_desc(topology_name="v5p:8x8x8", platform="tpu").devices)
    mesh = make_mesh(SIZES, devices=devs)
    specs = param_specs(cfg, "zero3_ep_tp", SIZES, p)
    tx, _ = make_optimizer(p, OptimConfig(state_dtype="bfloat16", muon_layout="owner"), mesh, specs)
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=sh), p, shard)
    by_shape = {tuple(x.shape): sh for x, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shard), strict=True)}
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=by_shape.get(
        tuple(x.shape), NamedSharding(mesh, PartitionSpec()))), jax.eval_shape(tx.init, params))

    def update(g, s, p):
        if not args.cond:
            return tx.update(g, s, p)
        g = jax.tree.map(lambda x: x * 0.5, g)

        def apply(_):
            u, s2 = tx.update(g, s, p)
            return optax.apply_updates(p, u), s2

        return jax.lax.cond(jnp.isfinite(optax.tree.norm(g)), apply, lambda _: (p, s), None)

    donate = (1, 2) if args.cond else (0, 1)
    compiled = jax.jit(update, donate_argnums=donate).lower(params, state, params).compile()
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write(compiled.as_text())
    stats = program_stats(compiled.as_text())
    print(f"HBM bytes {stats.bytes_accessed / 1e9:.1f} GB per chip; temporaries "
          f"{compiled.memory_analysis().temp_size_in_bytes / 1e9:.1f} GB")


if __name__ == "__main__":
    main()
