"""The MLA flash kernel per device under a row split (k3jax/sharding/row_split.py) on simulated CPU devices: k3-tiny's
logits and parameter gradients with the kernel under expert parallelism's row split against the XLA path, and
``kernel_rows`` saying exactly when a dispatch carries the split. The kernel call itself (rows, heads, documents,
gradients) is tested beside the context split's in test_context_parallel_kernels.py."""

import functools

import jax
import jax.numpy as jnp
import pytest

from k3jax.config import default_run, get_preset, with_kernels
from k3jax.model import forward, init_params
from k3jax.sharding.mesh import make_mesh
from k3jax.sharding.placement import expert_dispatch, kernel_rows
from k3jax.testing import TOL, assert_close


@pytest.fixture(autouse=True)
def _ieee_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def test_model_with_the_mla_kernel_under_expert_parallel_rows():
    """k3-tiny under expert parallelism on 2 devices (one row each): with ``mla_impl="pallas"`` its MLA layers run
    the flash kernel per device (``ExpertParallel.rows``); logits and the parameter gradients of a loss equal the
    XLA path's under the same dispatch."""
    cfg = get_preset("k3-tiny")
    runs = {i: default_run(cfg, mla_impl=i, mla_block_size=8) for i in ("pallas", "xla")}
    params = init_params(cfg, jax.random.key(0), runs["xla"])
    tok = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab_size)
    mesh = make_mesh({"expert": 2})
    ep = expert_dispatch("ep", mesh, batch=2)
    assert ep.rows is not None and ep.rows.row_axes == ("expert",)

    def loss(p, run):
        logits = forward(p, tok, cfg, run, dispatch=ep)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tok[..., None], -1)[..., 0]), logits

    def grads(run):
        (_, logits), g = jax.value_and_grad(loss, has_aux=True)(params, run)
        return logits, g

    with jax.set_mesh(mesh):
        got, want = (jax.jit(functools.partial(grads, runs[i]))() for i in ("pallas", "xla"))
        manual = {i: jax.jit(lambda p, run=runs[i]: forward(p, tok, cfg, run, dispatch=ep)).lower(params).as_text()
                  .count("sdy.manual_computation") for i in runs}
    n_mla = len(cfg.mla_layers)
    assert n_mla and manual["pallas"] == manual["xla"] + n_mla      # one shard_map per MLA layer: the kernel's
    assert_close(got[0], want[0], TOL["fp32_mesh_vs_single"], name="logits")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1]), strict=True):
        assert_close(a, b, TOL["fp32_grad"], name=f"d{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("axes,strategy,batch,split", [
    ({"expert": 2}, "ep", 2, True),                 # rows over the expert axis
    ({"expert": 2}, "ep", 1, False),                # the small-batch rule: every row on every device
    ({"data": 2}, "fsdp", 2, False),                # experts not sharded: no expert dispatch, no split
    ({"context": 2}, "fsdp", 1, False),             # sequences split: ContextParallel runs the kernels
])
def test_kernel_rows_says_when_the_dispatch_splits_rows(axes, strategy, batch, split):
    mesh = make_mesh(axes)
    assert kernel_rows(strategy, mesh, batch) is split
    small = batch < 2 and "context" not in axes
    dispatch = expert_dispatch(strategy, mesh, batch=batch, replicate_tokens=small) if strategy == "ep" else \
        expert_dispatch(strategy, mesh, batch=batch)
    assert (getattr(dispatch, "rows", None) is not None) is split
    run = with_kernels(default_run(get_preset("k3-tiny")), "auto", "tpu", devices=2, rows=split,
                       context="context" in axes)
    assert run.mla_impl == ("pallas" if split or "context" in axes else "xla")
