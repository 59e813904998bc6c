"""Speculative greedy decoding on the shipped k3-mini, its routed experts held as their stored MXFP4 bytes: 8
held-out prompts (ragged: 24 to 64 tokens) x 200 new tokens emit the tokens of plain greedy decoding wherever its
top-2 margin exceeds 1e-3, with the target's logits behind each token within 1e-5 — for K in {1, 4, 7}, both
rollbacks, and four drafters: the shipped draft (a freshly initialised one where the install has none), a freshly
initialised (useless) draft, the target drafting for itself (every block accepted) and one that alternates a whole
accepted block with a block rejected at its first token. Manual: about an hour on a 2-core CPU (the packed experts'
XLA loop; figures: experiments/LOG.md)."""

import numpy as np
import pytest
from test_speculative import _Alternating

from k3jax.checkpoint.load import load
from k3jax.checkpoint.source import default_ckpt
from k3jax.config import default_run
from k3jax.draft.measure import make_drafter, prompt_set, shipped_draft
from k3jax.draft.speculative import TargetDrafter, generate_speculative
from k3jax.model.generate import generate
from k3jax.testing import assert_same_greedy

pytestmark = pytest.mark.manual

N_NEW = 200


@pytest.fixture(scope="module")
def mini():
    ckpt = default_ckpt()
    if ckpt is None:
        pytest.skip("no shipped k3-mini in this install")
    cfg, params = load(ckpt, keep_experts_packed=True, progress=False)
    assert any("packed" in str(k) for k in _paths(params)), "the experts should stay MXFP4 bytes"
    run = default_run(cfg)
    prompts = prompt_set("low_entropy", count=8, length=64, vocab=cfg.vocab_size)
    for b, n in enumerate(np.linspace(24, 64, 8).astype(int)):             # ragged rows
        prompts[b, n:] = -1
    plain = generate(params, prompts, cfg, run, max_new_tokens=N_NEW)
    return ckpt, cfg, run, params, prompts, plain


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    else:
        yield prefix


@pytest.mark.parametrize("rollback", ["copy", "replay"])
@pytest.mark.parametrize("K", [1, 4, 7])
@pytest.mark.parametrize("which", ["draft", "random", "self", "alternating"])
def test_speculative_greedy_equals_greedy_on_k3_mini(mini, which, K, rollback):
    ckpt, cfg, run, params, prompts, plain = mini
    if which in ("draft", "random"):
        source = "shipped" if which == "draft" and shipped_draft(ckpt) else "random"
        drafter = make_drafter(source, params, cfg, run, K=K, ckpt=ckpt)
    else:
        drafter = (TargetDrafter if which == "self" else _Alternating)(params, cfg, run, K=K)
    spec = generate_speculative(params, prompts, cfg, run, drafter=drafter, max_new_tokens=N_NEW,
                                rollback_mode=rollback)
    compared = assert_same_greedy(spec.tokens, spec.logits, plain.tokens, plain.logits)
    hist = np.asarray(spec.timing["accepted_histogram"])
    print(f"\n{which} K={K} {rollback}: compared {compared}/{plain.tokens.size}, acceptance "
          f"{spec.timing['acceptance_length']:.3f}, histogram {hist.tolist()}")
    if which == "self":
        assert hist[K] >= 0.95 * hist.sum()
    if which == "alternating" and K > 1:
        assert hist[0] > 0 and hist[K] > 0
