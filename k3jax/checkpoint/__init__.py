"""HF <-> k3jax checkpoints: name map, our own safetensors reader, streaming sharded load, byte-exact save.

    from k3jax.checkpoint import load, save
    cfg, params = load("ckpt/")            # validate everything, then read only each device's bytes
    save(params, cfg, "out/")              # official K3 layout, byte-exact

    container.py  safetensors headers, the index, the manifest, file-name safety (no data read)
    io.py         Checkpoint: byte access (mmap views, preadv into buffers), bytes read, scale-byte checks
    plan.py       plan_load: names, shapes, dtypes checked against the name map -> Plan
    host.py       aligned host buffers, scratch, host transposes, RSS probes
    leaves.py     output leaves, LeafSource (one leaf's host values per device index), default sharding
    load.py       load(): the orchestration of the above
    save.py       save(): the official layout, byte-exact (safetensors_layout.py: headers without weights)
"""

from k3jax.checkpoint.container import read_header, verify_manifest
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.io import open_checkpoint
from k3jax.checkpoint.load import load
from k3jax.checkpoint.plan import plan_load
from k3jax.checkpoint.save import config_json, save

__all__ = ["CheckpointError", "config_json", "load", "open_checkpoint", "plan_load", "read_header", "save",
           "verify_manifest"]
