"""Hidden-state taps (``K3Model.extend / __call__(taps=...)``, what a draft model reads): the stream value after each
tapped layer is the same from the unrolled stack, the scanned one and the cached ``extend`` (prefix pieces), and a
tap after the last layer of a plain-residual stack is the stack's final hidden state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import default_run, get_preset, k3_full_attn_layers
from k3jax.model.cache import extend, init_cache
from k3jax.model.functional import init_params, merge
from k3jax.testing import TOL, assert_close


def _cfg(name, L, S):
    cfg = get_preset(name)
    return cfg.replace(num_layers=L, full_attn_layers=k3_full_attn_layers(L), attn_res_block_size=S)


# Default: 9 layers (head 0-3, one group 4-7, tail 8). Slow (CI's budget: ~40 s of compiles each here): 13 layers
# (two groups 4-11: a tap's select must pick its own group), the plain residual, the stacked cache.
@pytest.mark.parametrize("L,attn_res,layouts", [(9, 3, (False,)),
                                                pytest.param(13, 3, (False, True), marks=pytest.mark.slow),
                                                pytest.param(13, None, (False, True), marks=pytest.mark.slow)],
                         ids=["9_layers", "13_layers", "13_layers_plain"])
def test_taps_agree_across_stacks_and_cache(L, attn_res, layouts):
    cfg = _cfg("k3-tiny", L, attn_res)
    run = default_run(cfg)
    params = init_params(cfg, jax.random.key(0), run)
    taps = (1, 5, 8) if L == 9 else (1, 5, 10, 12)   # head, group 0 (and group 1, another slot), tail
    toks = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)  # two equal pieces: one compile
    _, aux = merge(params, cfg, run)(toks, return_aux=True, taps=taps)
    _, aux_s = merge(params, cfg, run.replace(layer_stack="scan"))(toks, return_aux=True, taps=taps)
    assert aux["taps"].shape == (2, 8, len(taps), cfg.hidden_size)
    assert_close(aux_s["taps"], aux["taps"], TOL["fp32_shallow"])
    # the cached path, in two pieces (flat and / or stacked caches)
    for stacked in layouts:
        cache = init_cache(cfg, 2, 16, run, stacked=stacked)
        _, cache, h1 = extend(params, toks[:, :4], None, cache, cfg, run, taps=taps)
        _, cache, h2 = extend(params, toks[:, 4:], None, cache, cfg, run, taps=taps)
        assert_close(jnp.concatenate([h1, h2], axis=1), aux["taps"], TOL["fp32_vs_fp64"])
    if attn_res is None:                           # the last layer's stream value is the final hidden state
        h, _ = merge(params, cfg, run).hidden_states(toks)
        np.testing.assert_array_equal(np.asarray(aux["taps"][:, :, -1]), np.asarray(h))
