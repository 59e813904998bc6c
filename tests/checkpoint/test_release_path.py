"""The release path at small scale: a K3-shaped checkpoint in the official layout with MXFP4 experts,
written by the project's writer → ``load`` onto an 8-device mesh with the experts kept packed and split over
``expert`` (each device's callbacks read only its experts' bytes) → ``forward`` through the expert-parallel dispatch
→ logits equal to the one-device float32 run of the same checkpoint (experts dequantized on load). Once in one
process with 8 devices, once over two ``jax.distributed`` processes of 4 devices each (release_2proc.py), whose
export (each process writing only the tensors it holds) is byte-identical to the one-process export.
"""

import jax
import numpy as np
import pytest

from k3jax.checkpoint import save
from k3jax.checkpoint.io import open_checkpoint
from k3jax.checkpoint.load import load
from k3jax.config import get_preset
from k3jax.model import forward, init_params
from k3jax.sharding import ExpertParallel, make_mesh
from k3jax.sharding.placement import batch_sharding
from k3jax.testing import TOL, assert_close, free_port


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


@pytest.mark.slow  # two processes (gloo collectives) + the one-process references
@pytest.mark.multiprocess
def test_two_process_release_path_and_sharded_export_equal_one_process(tmp_path):
    """The release path over two jax.distributed processes (tests/checkpoint/release_2proc.py): each process reads only
    its experts' bytes, the expert-parallel logits equal the one-device float32 run, and the export, written by both
    processes (each only the tensors it holds), is byte-identical to a one-process export of the same load."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    cfg = get_preset("k3-tiny").replace(expert_format="mxfp4")
    save(init_params(cfg, jax.random.key(0)), cfg, tmp_path / "ck")
    script = Path(__file__).with_name("release_2proc.py")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, str(tmp_path / "ck"), str(tmp_path / "two"),
                               str(tmp_path / "res")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)

    res = [json.loads((tmp_path / "res" / f"process{i}.json").read_text()) for i in (0, 1)]
    assert sorted(res[0]["experts_held"] + res[1]["experts_held"]) == list(range(cfg.num_experts))
    assert not set(res[0]["experts_held"]) & set(res[1]["experts_held"])
    ck = open_checkpoint(str(tmp_path / "ck"))
    expert_bytes = sum(e.nbytes for n, e in ck.tensors.items() if ".experts." in n)
    other = sum(e.nbytes for e in ck.tensors.values()) - expert_bytes
    ck.close()
    for r in res:  # each read its own half of the routed experts and the replicated rest, nothing else
        assert r["bytes_read"] == other + expert_bytes // 2, r
    print(f"\nbytes read per process: {[r['bytes_read'] for r in res]} of {res[0]['checkpoint_bytes']}")

    one = make_mesh({"expert": 1}, devices=jax.devices()[:1])
    _, dense = load(tmp_path / "ck", cfg=cfg, mesh=one, progress=False)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)
    ref = jax.jit(lambda p, t: forward(p, t, cfg))(dense, tokens)
    e = assert_close(np.load(tmp_path / "res" / "logits.npy"), np.asarray(ref), TOL["fp32_shallow"], name="logits")
    print(f"two processes (expert-parallel, packed) vs one device float32: logits rel-RMS {e:.2e}")

    _, packed = load(tmp_path / "ck", cfg=cfg, mesh=make_mesh({"expert": 8}), keep_experts_packed=True,
                     progress=False)
    save(packed, cfg, tmp_path / "one")
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for n in names:
        assert (tmp_path / "one" / n).read_bytes() == (tmp_path / "two" / n).read_bytes(), n
    assert not list(tmp_path.glob(".two.tmp-dist*"))  # the temporary directory was renamed into place
