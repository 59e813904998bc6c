"""Two processes on localhost (jax.distributed, CPU, 4 devices each) each load their half of the experts."""

import json
import os
import subprocess
import sys

import jax
import numpy as np

from k3jax.checkpoint.io import open_checkpoint
from k3jax.checkpoint.save import save
from k3jax.config import get_preset
from k3jax.model import abstract_params
from k3jax.testing import free_port

CFG = get_preset("k3-tiny")

WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax
import numpy as np
ckpt, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
from k3jax.checkpoint.load import load
from k3jax.checkpoint.io import open_checkpoint
from k3jax.config import get_preset
from k3jax.sharding.mesh import make_mesh
cfg = get_preset("k3-tiny")
mesh = make_mesh({"expert": jax.device_count()})
stats = {}
_, p = load(ckpt, cfg=cfg, mesh=mesh, keep_experts_packed=True, progress=False, stats=stats)
ck = open_checkpoint(ckpt)
ok, experts = True, set()
for l in range(1, cfg.num_layers):
    a = p["pre"][l]["moe"]["experts"]["w2_packed"]  # k3-tiny: no stacked group, every layer in "pre"
    for s in a.addressable_shards:
        for j, e in enumerate(range(8)[s.index[0]]):
            experts.add(e)
            want = ck.read(f"language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight_packed")
            ok &= bool(np.array_equal(np.asarray(s.data)[j], want))
emb = p["embed"].addressable_shards[0].data
ok &= bool(np.array_equal(np.asarray(emb).astype(np.float32),
                          ck.read("language_model.model.embed_tokens.weight").astype(np.float32)))
print("RESULT " + json.dumps({"ok": ok, "bytes_read": stats["bytes_read"], "experts": sorted(experts),
                              "global_shape": list(a.shape), "process_count": jax.process_count()}))
jax.distributed.shutdown()
"""


def test_two_processes_each_read_half_the_experts(tmp_path):
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), abstract_params(CFG))
    save(params, CFG, tmp_path / "ck")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "ck"), str(port), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    results = []
    try:
        for pr in procs:
            out, err = pr.communicate(timeout=240)
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            assert pr.returncode == 0 and line, err[-3000:]
            results.append(json.loads(line[0][7:]))
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
    ck = open_checkpoint(tmp_path / "ck")
    expert_bytes = sum(e.nbytes for n, e in ck.tensors.items() if ".experts." in n)
    other = sum(e.nbytes for e in ck.tensors.values()) - expert_bytes
    assert [r["experts"] for r in results] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for r in results:
        assert r["ok"] and r["process_count"] == 2 and r["global_shape"] == [8, 32, 16]
        assert r["bytes_read"] == other + expert_bytes // 2
