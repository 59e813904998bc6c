# ruff: noqa: E401, E402, E501, E701, I001  (measurement script: environment set before the jax import)
"""Session-9 closed form (experiments/LOG.md): kimi-k3 Muon leaves on fsdp 8 x expert 64 that are whole matrices
sharded over fsdp, and the fp32 bytes a per-step all-gather of them would move. Usage: .venv/bin/python experiments/muon_gather.py"""
import os
os.environ["JAX_PLATFORMS"]="cpu"
import jax, math
from k3jax.config import get_preset
from k3jax.model import abstract_params
from k3jax.optim.optimizer import leaf_rule
from k3jax.sharding.rules import param_specs
from k3jax.sharding.placement import parse_mesh
from k3jax.pytree import key_names
cfg = get_preset("kimi-k3")
p = abstract_params(cfg)
sizes = parse_mesh("fsdp=8,expert=64")
specs = param_specs(cfg, "fsdp_ep_tp", sizes, p)
tot = {"full_fsdp": 0, "per_block": 0, "full_unsharded": 0}
for (path, x), (_, s) in zip(jax.tree_util.tree_leaves_with_path(p), jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))):
    lab, mdn, _ = leaf_rule(path, x)
    if lab != "muon": continue
    names = key_names(path)
    axes = [a for e in s for a in ((e,) if isinstance(e, str) else (e or ()))]
    full = "experts" not in names and not (mdn.reduction_axis == 0 and x.ndim - (names[0]=="groups") == 3 and names[-1] not in ("wo",))
    n = math.prod(x.shape)
    if "experts" in names or not full: tot["per_block"] += n
    elif "fsdp" in axes: tot["full_fsdp"] += n
    else: tot["full_unsharded"] += n
print({k: f"{v/1e9:.2f}G params" for k, v in tot.items()})
print("fp32 all-gather per step of the fsdp-sharded full matrices, received per device:", f"{tot['full_fsdp']*4*7/8/1e9:.1f} GB")
