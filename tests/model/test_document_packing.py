"""Document-masked packing (docs/model.md §4.7): documents packed in one row give each document's own
per-token losses and gradients — through KDA (its state and its short conv), MLA and the whole network."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.config import default_run, get_preset
from k3jax.model import forward, init_params
from k3jax.testing import TOL, assert_close

CFG = get_preset("k3-tiny")  # KDA (chunk 16, conv 4) and MLA (key blocks of 8) layers, MoE, AttnRes
# three documents: boundaries inside a KDA chunk and an MLA key block, a one-token document, a chunk-aligned end
LENS = (23, 1, 40)


def _docs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in LENS]


def _ce(params, tokens, run, seg=None):
    """Per-token next-token cross-entropy of a [1, L] row (L - 1 predictions)."""
    t = jnp.asarray(tokens)[None]
    s = None if seg is None else jnp.asarray(seg)[None, :-1]
    logits = forward(params, t[:, :-1], CFG, run, segment_ids=s)
    return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:])[0]


def _packed_vs_alone(params, run):
    docs = _docs()
    row = np.concatenate(docs)
    seg = np.repeat(np.arange(len(docs)) + 5, LENS)
    packed = np.asarray(jax.jit(lambda p, t, s: _ce(p, t, run, s))(params, row, seg))
    got, want, at = [], [], 0
    for d in docs:
        n = len(d)
        if n > 1:            # a document's own predictions; the one across each boundary is never scored
            got.append(packed[at:at + n - 1])
            want.append(np.asarray(_ce(params, d, run)))
        at += n
    return np.concatenate(got), np.concatenate(want)


@pytest.mark.parametrize("kw", [{}, {"layer_stack": "scan", "remat": "full"},
                                pytest.param({"kda_impl": "recurrent"}, marks=pytest.mark.slow),
                                pytest.param({"kda_impl": "pallas"}, marks=pytest.mark.slow)],  # CI's budget
                         ids=["chunked", "scan-remat", "recurrent", "pallas"])
def test_packed_row_losses_equal_each_document_alone(kw):
    run = dataclasses.replace(default_run(CFG), **kw)
    params = init_params(CFG, jax.random.key(0), run)
    got, want = _packed_vs_alone(params, run)
    assert_close(got, want, TOL["fp32_shallow"], name="per-token losses")


def test_without_masks_documents_leak():
    """The control: with no segment ids the later documents see the earlier ones (the test above can fail)."""
    run = default_run(CFG)
    params = init_params(CFG, jax.random.key(0), run)
    docs = _docs()
    row = np.concatenate(docs)
    packed = np.asarray(_ce(params, row, run))
    alone = np.asarray(_ce(params, docs[2], run))
    assert np.max(np.abs(packed[LENS[0] + LENS[1]:] - alone)) > 1e-3


def test_packed_gradients_equal_the_sum_over_documents():
    """d(sum of the packed row's in-document losses) == the sum of each document's own gradient (f32)."""
    run = default_run(CFG)
    params = init_params(CFG, jax.random.key(1), run)
    docs = _docs(1)
    row = np.concatenate(docs)
    seg = np.repeat(np.arange(len(docs)), LENS)
    keep = jnp.asarray((seg[1:] == seg[:-1]).astype(np.float32))
    g_packed = jax.jit(jax.grad(lambda p: jnp.sum(_ce(p, row, run, seg) * keep)))(params)
    g_alone = jax.tree.map(jnp.zeros_like, params)
    for d in docs:
        if len(d) > 1:
            g = jax.jit(jax.grad(lambda p, d=d: jnp.sum(_ce(p, d, run))))(params)
            g_alone = jax.tree.map(jnp.add, g_alone, g)
    flat_p, flat_a = jax.tree.leaves_with_path(g_packed), jax.tree.leaves(g_alone)
    for (path, a), b in zip(flat_p, flat_a, strict=True):
        if np.any(np.asarray(b) != 0):
            assert_close(a, b, TOL["fp32_grad"], name=jax.tree_util.keystr(path))
