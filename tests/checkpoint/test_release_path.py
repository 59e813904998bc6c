"""The release path at small scale (#14 item 3, single process): a K3-shaped checkpoint in the official layout with
MXFP4 experts, written by the project's writer → ``load`` onto an 8-device mesh with the experts kept packed and
split over ``expert`` (each device's callbacks read only its experts' bytes) → ``forward`` through the
expert-parallel dispatch → logits equal to the one-device float32 run of the same checkpoint (experts dequantized
on load). The 2-process ``jax.distributed`` version is not built yet.
"""

import jax
import numpy as np
import pytest

from k3jax.checkpoint import save
from k3jax.checkpoint.load import load
from k3jax.config import get_preset
from k3jax.model import forward, init_params
from k3jax.sharding import ExpertParallel, make_mesh
from k3jax.sharding.placement import batch_sharding
from k3jax.testing import TOL, assert_close


@pytest.mark.slow  # two k3-tiny forward compiles, one on 8 devices with the shard_map dispatch
def test_packed_release_checkpoint_on_8_devices_equals_one_device_float32(tmp_path):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    cfg = get_preset("k3-tiny").replace(expert_format="mxfp4")
    save(init_params(cfg, jax.random.key(0)), cfg, tmp_path / "ck")
    mesh = make_mesh({"expert": 8})
    _, packed = load(tmp_path / "ck", cfg=cfg, mesh=mesh, keep_experts_packed=True, progress=False)
    stacks = [x for p, x in jax.tree_util.tree_leaves_with_path(packed) if "_packed" in jax.tree_util.keystr(p)]
    assert stacks and all(x.dtype == np.uint8 for x in stacks)
    for x in stacks:  # [E, out, in/2]: one expert per device
        assert {s.data.shape[0] for s in x.addressable_shards} == {1}
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)
    ep = ExpertParallel(mesh, "ep")
    bsh = batch_sharding("ep", mesh, 2)
    logits = jax.jit(lambda p, t: forward(p, t, cfg, dispatch=ep))(packed, jax.device_put(tokens, bsh))

    one = make_mesh({"expert": 1}, devices=jax.devices()[:1])
    _, dense = load(tmp_path / "ck", cfg=cfg, mesh=one, progress=False)  # experts dequantized to float32
    ref = jax.jit(lambda p, t: forward(p, t, cfg))(dense, tokens)
    e = assert_close(np.asarray(logits), np.asarray(ref), TOL["fp32_shallow"], name="logits")
    print(f"\npacked on 8 devices (expert-parallel) vs one device float32: logits rel-RMS {e:.2e}")
