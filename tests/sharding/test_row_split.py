"""The MLA flash kernel per device under a row split (k3jax/sharding/row_split.py) on simulated CPU devices: rows over
one axis, heads over another, with packed documents — forward, max logit and the gradients of all five inputs
against one device's attention over the built keys; k3-tiny's logits and parameter gradients with the kernel under
expert parallelism's row split against the XLA path; and ``kernel_rows`` saying exactly when a dispatch carries
the split."""

import functools
import math

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3jax.config import default_run, get_preset, with_kernels
from k3jax.model import forward, init_params
from k3jax.ops.attention import causal_attention
from k3jax.sharding.mesh import make_mesh
from k3jax.sharding.placement import expert_dispatch, kernel_rows
from k3jax.sharding.row_split import RowSplit
from k3jax.testing import TOL, assert_close
from pallas_kernels.mla.flash import mla_flash
from pallas_kernels.mla.flash_reference import build_kv

N, HN, HR, V, R = 2, 8, 4, 8, 16  # small MLA: heads, nope, rope slice, value, latent
SCALE = 1.0 / math.sqrt(HN + HR)


@pytest.fixture(autouse=True)
def _ieee_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _inputs(B, T):
    k = jax.random.split(jax.random.key(4), 6)
    return [jax.random.normal(k[0], (B, T, N, HN + HR)), jax.random.normal(k[1], (B, T, R)) / 3,
            jax.random.normal(k[2], (B, T, HR)), jax.random.normal(k[3], (R, N, HN)) / 3,
            jax.random.normal(k[4], (R, N, V)) / 3], jax.random.normal(k[5], (B, T, N, V))


def _with_grads(f, args, ct):
    def run(*a):
        (o, m), vjp = jax.vjp(f, *a)
        return o, m, vjp((ct, jnp.zeros_like(m)))
    return jax.jit(run)(*args)


@pytest.mark.parametrize("axes,rows,heads", [({"data": 2}, ("data",), ()), ({"tensor": 2}, (), ("tensor",))],
                         ids=["rows", "heads"])
def test_latent_flash_per_device_equals_one_device(axes, rows, heads):
    """The Pallas flash kernel (TPU schedule, in the TPU interpreter) run per device on its rows or heads, with packed
    documents (row 0 three documents, row 1 one): one device's attention over the built keys, its max logit, and
    the gradients of q, the latent, the key slice and both up-projections (summed over the rows by shard_map)."""
    B, T = 2, 20                                                  # 20 tokens: blocks of 8 do not divide it
    args, ct = _inputs(B, T)
    seg = jnp.zeros((B, T), jnp.int32).at[0, 5:].set(1).at[0, 13:].set(2)
    mesh = make_mesh(axes)
    split = RowSplit(mesh, rows, heads)
    flash = functools.partial(mla_flash, scale=SCALE, block_q=8, block_k=8, platform="tpu",
                              interpret=pltpu.InterpretParams())

    def one_device(q, c, r, wk, wv):
        k, v = build_kv(c, r, wk, wv, jnp.float32)
        return causal_attention(q, k, v, scale=SCALE, block_size=8, segment_ids=seg)

    want = _with_grads(one_device, args, ct)
    with jax.set_mesh(mesh):
        got = _with_grads(lambda *a: split.latent_flash(flash, *a, segment_ids=seg), args, ct)
    assert_close(got[0], want[0], TOL["fp32_vs_fp64"], name="o")
    assert_close(got[1], want[1], TOL["fp32_vs_fp64"], name="max_logit")
    for name, a, b in zip(("q", "c_kv", "k_rope", "w_uk", "w_uv"), got[2], want[2], strict=True):
        assert_close(a, b, TOL["fp32_grad"], name=f"d{name}")


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
