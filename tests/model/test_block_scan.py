"""The scanned AttnRes stack's backward that rebuilds the block-sum buffer (``k3jax/model/block_scan.py``): on a
stack of several groups, with commits at different positions of the group, its gradients equal the unrolled stack's
without remat, and it is the path ``remat="full"`` and ``remat="group"`` take."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.bench.compile import compile_train_grad, temp_bytes
from k3jax.config import default_run, get_preset, k3_full_attn_layers
from k3jax.model import init_params, layout, network
from k3jax.testing import TOL, assert_close

B, T = 2, 16


def _cfg(block: int):
    # k3-tiny widths, 13 layers: unrolled head 0-3 (dense layer 0), two stacked groups 4-7 and 8-11, tail 12
    return get_preset("k3-tiny", num_layers=13, full_attn_layers=k3_full_attn_layers(13), attn_res_block_size=block)


@pytest.mark.slow
# block 2: commits at positions 0 and 2 of every group; block 3: at 2 (group 1), 1 (group 2). "full" checkpoints each
# layer inside a group's backward, "group" differentiates the recomputed group whole: both take block_scan's path
@pytest.mark.parametrize("block,remat", [(2, "full"), (3, "full"), (2, "group")])
def test_rebuilt_buffer_gives_the_gradients_of_the_unrolled_stack(block, remat, monkeypatch):
    cfg = _cfg(block)
    assert layout(cfg).groups == 2
    params = init_params(cfg, jax.random.key(0), default_run(cfg))
    toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    used = []
    real = network.scan_saving_parts
    monkeypatch.setattr(network, "scan_saving_parts", lambda *a, **k: used.append(1) or real(*a, **k))
    names = []  # the remat of every layer checkpoint made: "full" inside a group's backward only under "full"
    real_ckpt = network.K3Model._checkpointed
    monkeypatch.setattr(network.K3Model, "_checkpointed",
                        staticmethod(lambda fn, name: names.append(name) or real_ckpt(fn, name)))
    got_fn = compile_train_grad(cfg, default_run(cfg, layer_stack="scan", remat=remat), batch=B, seq_len=T)
    assert used, f"remat={remat!r} on the scanned AttnRes stack did not take block_scan's path"
    assert ("full" in names) == (remat == "full"), names
    ref_fn = compile_train_grad(cfg, default_run(cfg, layer_stack="loop", remat="none"), batch=B, seq_len=T)
    ((got_loss, _), got), ((ref_loss, _), ref) = got_fn(params, toks), ref_fn(params, toks)
    assert_close(got_loss, ref_loss, TOL["fp32_vs_fp64"], name="loss")
    leaves = jax.tree_util.tree_leaves_with_path(ref)
    for (path, a), b in zip(leaves, jax.tree.leaves(got), strict=True):
        assert_close(b, a, TOL["fp32_vs_fp64"], atol_floor=1e-12,
                     name=f"S={block} {remat} grad {jax.tree_util.keystr(path)}")
    print(f"S={block} {remat}: temp bytes {temp_bytes(got_fn):,}")
