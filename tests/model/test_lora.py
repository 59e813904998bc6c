"""LoRA adapters in the model (k3jax/layers/lora.py): a fresh adapter is the base bit for bit, an
adapter equals its merged weight, on every target and both layer stacks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config.lora import parse_lora
from k3jax.config import LORA_TARGETS, ConfigError, LoRAConfig, default_run, get_preset
from k3jax.layers.lora import is_adapter, split_adapters
from k3jax.model import forward, init_params
from k3jax.ops.lora import lora_weight
from k3jax.testing import TOL, assert_close

CFG = get_preset("k3-tiny")
ALL = LoRAConfig(rank=4, alpha=8.0, targets=LORA_TARGETS)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)))


def _runs(stack):
    run = dataclasses.replace(default_run(CFG), layer_stack=stack)
    return run, run.replace(lora=ALL)


@pytest.mark.parametrize("stack", ["loop", "scan"])
def test_fresh_adapters_give_the_base_logits_bit_for_bit(stack):
    run, lrun = _runs(stack)
    base = init_params(CFG, jax.random.key(0), run)
    adapted = init_params(CFG, jax.random.key(0), lrun)
    ad, rest = split_adapters(adapted)
    assert jax.tree.structure(rest) == jax.tree.structure(base)      # the base is the plain model's, same draws
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(rest), jax.tree.leaves(base), strict=True))
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ad)}
    for leaf in ("['kda']['wq_lora_a']", "['mla']['kv_b_lora_b']", "['mlp']['w_down_lora_a']",
                 "['shared']['w_up_lora_b']", "['experts']['w2_lora_a']"):
        assert any(leaf in n for n in names), leaf
    assert np.array_equal(forward(base, TOKENS, CFG, run), forward(adapted, TOKENS, CFG, lrun))


def _merged(adapted, scale):
    """The base tree with every adapted leaf replaced by W + scale A B (``ops.lora.lora_weight``)."""
    def walk(node):
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items() if not is_adapter(k)}
        for k in list(out):
            if f"{k}_lora_a" in node:
                out[k] = lora_weight(node[k], node[f"{k}_lora_a"], node[f"{k}_lora_b"], scale)
        return out
    return walk(adapted)


@pytest.mark.parametrize("stack", ["loop", "scan"])
def test_adapters_equal_their_merged_weights(stack):
    """Random nonzero B: the low-rank paths (and the merged kv_b of decode) == the plain model on W + s A B."""
    run, lrun = _runs(stack)
    adapted = init_params(CFG, jax.random.key(1), lrun)
    rng = np.random.default_rng(2)
    adapted = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype)
        if jax.tree_util.keystr(p).endswith("_lora_b']") else x, adapted)
    got = forward(adapted, TOKENS, CFG, lrun)
    want = forward(_merged(adapted, ALL.scale), TOKENS, CFG, run)
    assert not np.allclose(got, forward(split_adapters(adapted)[1], TOKENS, CFG, run), atol=1e-3)
    assert_close(got, want, TOL["fp32_shallow"], name="logits")


@pytest.mark.parametrize("text,msg", [("rank=0", "rank"), ("targets=attn+mlp", "targets"), ("rank=4,beta=2", "beta"),
                                      ("alpha=x", "alpha"), ("dropout=1", "dropout"), ("dropout=-0.1", "dropout"),
                                      ("dropout=nan", "dropout")])
def test_bad_lora_settings_name_the_field(text, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_lora(text)
