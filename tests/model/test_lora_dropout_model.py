"""LoRA dropout through the model and the train step (``forward(..., dropout_key=)``, ``make_train_step``): without
a key, or at rate 0, the traced program is the plain one; the step draws its masks from state["rng"], the step
counter and the micro-batch index (same state: same step; another step: other masks); the scanned stack and its
remat backward draw the masks the loop draws (the layer index is folded in, traced or not)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.config import LORA_TARGETS, LoRAConfig, default_run, get_preset, k3_full_attn_layers
from k3jax.layers.lora import split_adapters
from k3jax.model import abstract_params, forward, init_params
from k3jax.testing import TOL, assert_close, jaxpr_eqns
from k3jax.train.step import StepSpec, init_state, make_train_step

TINY = get_preset("k3-tiny")
TOKENS = jax.ShapeDtypeStruct((2, 16), jnp.int32)
PRNG = ("random_bits", "random_fold_in", "threefry2x32", "random_wrap")


def _run(cfg, rate, **kw):
    return dataclasses.replace(default_run(cfg), **kw).replace(
        lora=LoRAConfig(rank=4, alpha=8.0, targets=LORA_TARGETS, dropout=rate))


def _fwd_jaxpr(cfg, run, key):
    """The forward's jaxpr; ``key`` (or None) closed over, so that an unused key leaves no trace in it."""
    return str(jax.make_jaxpr(lambda p, t: forward(p, t, cfg, run, dropout_key=key))(abstract_params(cfg, run),
                                                                                        TOKENS))


def test_no_key_or_rate_zero_traces_the_plain_forward():
    """Rate 0 with a key, and any rate without one (evaluation, scoring, generation), trace exactly the program of a
    forward without a key: no PRNG op, the same equations (a rate with a key draws masks: the slow step test)."""
    plain = _fwd_jaxpr(TINY, _run(TINY, 0.0), None)
    assert not any(p in plain for p in PRNG)
    assert _fwd_jaxpr(TINY, _run(TINY, 0.0), jax.random.key(0)) == plain
    assert _fwd_jaxpr(TINY, _run(TINY, 0.1), None) == plain


def _state_and_step(run, M=2):
    params = init_params(TINY, jax.random.key(0), run)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map_with_path(      # a trained adapter: B off zero, so dropout moves the loss
        lambda p, x: jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype)
        if jax.tree_util.keystr(p).endswith("_lora_b']") else x, params)
    ad, rest = split_adapters(params)
    tx = optax.adamw(1e-3)
    step = make_train_step(TINY, run, tx, StepSpec(balance="off", qk_clip=False))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, TINY.vocab_size, (M, 2, 17)), jnp.int32)
    return init_state(ad, tx, 0, frozen=rest), step, tokens


@pytest.mark.slow  # two k3-tiny train-step traces, two compiles: 82 s on the 2-core CPU (7 min under other jobs)
def test_train_step_masks_follow_rng_step_and_micro_batch():
    run0, run1 = _run(TINY, 0.0), _run(TINY, 0.2)
    state, step0, tokens = _state_and_step(run0)
    _, step1, _ = _state_and_step(run1)
    jx0 = jax.make_jaxpr(step0)(state, tokens, jnp.float32(0))
    assert not any(p in e.primitive.name for e in jaxpr_eqns(jx0.jaxpr) for p in PRNG)   # rate 0: no key at all
    step1 = jax.jit(step1)
    _, m1 = step1(state, tokens, jnp.float32(0))
    _, again = step1(state, tokens, jnp.float32(0))
    _, later = step1(dict(state, step=jnp.int32(5)), tokens, jnp.float32(0))
    _, seeded = step1(dict(state, rng=jax.random.key_data(jax.random.key(7))), tokens, jnp.float32(0))
    assert bool(m1["finite"]) and float(m1["grad_norm"]) > 0
    assert float(m1["loss"]) == float(again["loss"]) and float(m1["grad_norm"]) == float(again["grad_norm"])
    assert len({float(m["loss"]) for m in (m1, later, seeded)}) == 3       # another step or seed: other masks
    assert any(p in e.primitive.name for e in jaxpr_eqns(jax.make_jaxpr(step1)(state, tokens, jnp.float32(0)).jaxpr)
               for p in PRNG)
    # one micro-batch twice: the second draws other masks (its index is folded in), so the mean is not the first's
    doubled = jnp.concatenate([tokens[:1], tokens[:1]])
    _, single = step1(state, tokens[:1], jnp.float32(0))
    _, both = step1(state, doubled, jnp.float32(0))
    assert float(both["loss"]) != float(single["loss"])


@pytest.mark.manual  # three k3-tiny-9 gradient compiles: 12.6 min on the loaded 2-core CPU (passed, session 28)
def test_scanned_stack_and_its_remat_draw_the_loops_masks():
    """k3-tiny widths, 9 layers (one scanned group, an AttnRes commit inside it): loss and every gradient of the
    dropped forward equal across the loop, the scan, and the scan under remat "full" (block_scan's custom VJP
    recomputes each group in the backward: the same masks, or the gradients would differ)."""
    cfg = TINY.replace(num_layers=9, full_attn_layers=k3_full_attn_layers(9), attn_res_block_size=3)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)))
    out = {}
    for name, kw in {"loop": dict(layer_stack="loop"), "scan": dict(layer_stack="scan"),
                     "scan-remat": dict(layer_stack="scan", remat="full")}.items():
        run = _run(cfg, 0.3, **kw)
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.05 if jax.tree_util.keystr(p).endswith("_lora_b']") else x,
            init_params(cfg, jax.random.key(0), run))
        loss = jax.jit(jax.value_and_grad(lambda p, k, run=run: jnp.mean(forward(p, toks, cfg, run,
                                                                                dropout_key=k) ** 2)))
        out[name] = loss(params, jax.random.key(1))
        assert float(out[name][0]) != float(loss(params, None)[0])
    for name in ("scan", "scan-remat"):
        assert_close(out[name][0], out["loop"][0], TOL["fp32_shallow"], name=f"{name} loss")
        for (p, g), ref in zip(jax.tree_util.tree_leaves_with_path(out[name][1]), jax.tree.leaves(out["loop"][1]),
                               strict=True):
            assert_close(g, ref, TOL["fp32_grad"], atol_floor=1e-12, name=f"{name} {jax.tree_util.keystr(p)}")
