"""HF <-> k3jax checkpoints: name map, our own safetensors reader, streaming sharded load, byte-exact save.

    from k3jax.checkpoint import load, save
    cfg, params = load("ckpt/")            # validate everything, then read only each device's bytes
    save(params, cfg, "out/")              # official K3 layout, byte-exact
"""

from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.load import load, verify_manifest
from k3jax.checkpoint.reader import open_checkpoint, read_header, validate
from k3jax.checkpoint.save import config_json, save

__all__ = ["CheckpointError", "config_json", "load", "open_checkpoint", "read_header", "save", "validate",
           "verify_manifest"]
