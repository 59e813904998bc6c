# ruff: noqa: E402  (the environment and jax.distributed come before any other jax import)
"""One process of the 2-process release-path run (tests/checkpoint/test_release_path.py; also by hand):

    python tests/checkpoint/release_2proc.py PROCESS_ID PORT CHECKPOINT_DIR EXPORT_DIR RESULT_DIR

Two processes of 4 simulated CPU devices each join one jax.distributed runtime (gloo collectives across them);
each loads the MXFP4 checkpoint onto the global 8-device mesh with the routed experts kept packed and split over
``expert`` (reading only its own experts' bytes), runs the expert-parallel forward, and then both export the loaded
parameters into one directory, each writing only the tensors it holds. Process 0 saves the gathered logits; each
process saves what it read and held (RESULT_DIR/process{i}.json).
"""
import json
import os
import sys

pid, port, ck, export, result = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid, initialization_timeout=120)

import numpy as np
from jax.experimental import multihost_utils

from k3jax.checkpoint import save
from k3jax.checkpoint.load import load
from k3jax.config import get_preset
from k3jax.model import forward
from k3jax.sharding import ExpertParallel, make_mesh
from k3jax.sharding.placement import batch_sharding

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
cfg = get_preset("k3-tiny").replace(expert_format="mxfp4")
mesh = make_mesh({"expert": 8})
stats: dict = {}
_, packed = load(ck, cfg=cfg, mesh=mesh, keep_experts_packed=True, progress=False, stats=stats)
experts_held = sorted({int(s.index[0].start or 0) for p, x in jax.tree_util.tree_leaves_with_path(packed)
                       if "w1_packed" in jax.tree_util.keystr(p) for s in x.addressable_shards})
tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)
bsh = batch_sharding("ep", mesh, 2)
tok = jax.make_array_from_callback(tokens.shape, bsh, lambda idx: tokens[idx])
logits = jax.jit(lambda p, t: forward(p, t, cfg, dispatch=ExpertParallel(mesh, "ep")))(packed, tok)
full = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
save(packed, cfg, export)
os.makedirs(result, exist_ok=True)
if pid == 0:
    np.save(os.path.join(result, "logits.npy"), full)
with open(os.path.join(result, f"process{pid}.json"), "w") as f:
    json.dump({"bytes_read": stats["bytes_read"], "checkpoint_bytes": stats["checkpoint_bytes"],
               "experts_held": experts_held, "devices": [d.id for d in jax.local_devices()]}, f)
jax.distributed.shutdown()
