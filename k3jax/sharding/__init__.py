"""k3jax.sharding — all code that knows a mesh exists (docs/design.md §2).

    mesh.py             make_mesh({"data": 2, "expert": 4}); axes data, fsdp, expert, context, tensor (Auto axis types)
    rules.py            the logical-axis → mesh-axis table (a column per strategy); per-parameter logical axes come
                        from the Params' metadata;
                        param_specs / param_shardings
    expert_parallel.py  ExpertParallel: shard_map all-to-all MoE dispatch, passed to the MoE layer as dispatch=
    context_parallel.py ContextParallel: one sequence split over the context axis (KDA state scan, gathered MLA
                        latent), passed to the model as dispatch= (or inside an ExpertParallel)
    qb.py               the Quantile Balancing update on a mesh: one integer all-reduce per layer (the math:
                        k3jax/optim/qb.py)
"""

from k3jax.sharding.context_parallel import ContextParallel
from k3jax.sharding.expert_parallel import ExpertParallel, bucket_capacity
from k3jax.sharding.mesh import MESH_AXES, make_mesh
from k3jax.sharding.qb import qb_update_sharded
from k3jax.sharding.rules import RULES, STRATEGIES, get_rules, param_shardings, param_specs

__all__ = ["ContextParallel", "ExpertParallel", "bucket_capacity", "MESH_AXES", "make_mesh", "qb_update_sharded",
           "RULES", "STRATEGIES", "get_rules", "param_shardings", "param_specs"]
