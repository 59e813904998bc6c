"""Adding a leaf is one edit: a parameter created in one block's ``__init__`` plus its row in that block's ``HF``
table reaches init, the sharding rules, the HF name map, the planner and the optimizer with no other change."""

import jax
import jax.numpy as jnp

from k3jax.checkpoint.name_map import hf_tensors, leaf_shapes
from k3jax.config import get_preset
from k3jax.layers import ffn
from k3jax.layers.common import param, vec
from k3jax.model import abstract_params, count_params, init_params
from k3jax.optim.optimizer import OptimConfig, make_optimizer
from k3jax.plan.formula import build_plan
from k3jax.sharding.rules import param_specs


def test_a_leaf_added_to_one_block_reaches_init_rules_name_map_planner_and_optimizer(monkeypatch):
    base_cfg = get_preset("k3-tiny", vocab_size=98)  # even, so "vocab" splits over tensor=2
    base_total = build_plan(base_cfg)["total_params"]
    real_init = ffn.GLU.__init__

    def init(self, *, d, hidden, dtype=jnp.float32, rngs):
        real_init(self, d=d, hidden=hidden, dtype=dtype, rngs=rngs)
        self.extra = param(jnp.full((hidden,), 2.0, dtype), ("mlp",))  # the one new leaf

    monkeypatch.setattr(ffn.GLU, "__init__", init)
    monkeypatch.setitem(ffn.GLU.HF, "extra", vec("extra_scale.weight"))  # ... and its HF row
    cfg = base_cfg.replace(name="one-edit")  # a new config, so no cached tree of the unedited model is reused

    params = init_params(cfg, jax.random.key(0))
    assert float(params["pre"][0]["mlp"]["extra"][0]) == 2.0  # the dense layer-0 FFN
    assert params["pre"][1]["moe"]["shared"]["extra"].shape == (cfg.shared_hidden,)  # the shared experts

    specs = param_specs(cfg, "ep_tp", {"expert": 2, "tensor": 2})
    assert specs["pre"][0]["mlp"]["extra"] == jax.sharding.PartitionSpec("tensor")  # "mlp" → tensor under ep_tp

    names = {s.name: s for s in hf_tensors(cfg)}
    dense = names["language_model.model.layers.0.mlp.extra_scale.weight"]
    assert (dense.shape, dense.dtype, dense.transform) == ((cfg.intermediate_size,), "BF16", "copy")
    moe_layers = [l for l in range(cfg.num_layers) if cfg.is_moe(l)]
    for l in moe_layers:
        assert f"language_model.model.layers.{l}.block_sparse_moe.shared_experts.extra_scale.weight" in names
    assert leaf_shapes(cfg)[("layers", 0, "mlp", "extra")] == (cfg.intermediate_size,)

    added = cfg.intermediate_size + len(moe_layers) * cfg.shared_hidden
    assert count_params(abstract_params(cfg)) == count_params(abstract_params(base_cfg)) + added
    plan = build_plan(cfg)
    assert plan["total_params"] == base_total + added
    assert plan["checkpoint_tensors"] == build_plan(base_cfg)["checkpoint_tensors"] + 1 + len(moe_layers)

    # the optimizer: a vector gets AdamW without decay (the 1-D rule), and an update moves it (the second: the
    # schedule's warm-up starts at lr 0)
    tx, labels = make_optimizer(params, OptimConfig(lr=1e-2, total_steps=10))
    assert labels["pre"][0]["mlp"]["extra"] == "adam_nodecay"
    grads, state = jax.tree.map(jnp.ones_like, params), tx.init(params)
    for _ in range(2):
        updates, state = tx.update(grads, state, params)
    step = updates["pre"][0]["mlp"]["extra"]
    assert step.shape == (cfg.intermediate_size,) and bool(jnp.all(step < 0))  # against a positive gradient
