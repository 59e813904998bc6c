"""Full-scale dry run: the official 96-file K3 layout as sparse files (real headers, holes for the data).

    info = make_sparse_checkpoint("/tmp/k3-sparse", vision_tsv="tensors_vision.tsv")  # the release's 168 vision tensors

Every shard gets its real u64 length and header (from the name map and ``safetensors_layout``), then is extended
with ``os.truncate`` to its exact published size, so the ~1.56 TB of payload are holes that take no disk space and
read back as zeros. The index (497,220 entries, ~60 MB) and config.json are real. Loader tests can then open the
real-size headers and read slices (e.g. one device's eighth of a layer's experts) and count the bytes read.
"""

from __future__ import annotations

import os
import shutil

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.container import INDEX_NAME
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.safetensors_layout import shard_file_name, shard_layout
from k3jax.checkpoint.save import config_json, index_json
from k3jax.config import get_preset

# headers (~76 MB) + index (~60 MB) + slack; the payload is holes
MIN_FREE_BYTES = 1 << 30


def read_vision_tsv(path: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``name  dtype  shape`` rows (header line first; shape comma-separated) of ``tensors_vision.tsv``."""
    out = []
    with open(path, encoding="utf-8") as f:
        next(f)
        for line in f:
            if line.strip():
                name, dtype, shape = line.rstrip("\n").split("\t")
                out.append((name, dtype, tuple(int(x) for x in shape.split(",") if x)))
    return out


def make_sparse_checkpoint(out_dir, cfg=None, *, vision_tsv: str | None = None,
                           min_free_bytes: int = MIN_FREE_BYTES) -> dict:
    """Write the sparse layout of ``cfg`` (default: the kimi-k3 preset) into ``out_dir``.

    Returns {"files": [...], "file_bytes": {file: size}, "total_size": payload bytes, "allocated_bytes": disk use}.
    Raises CheckpointError when free space is below ``min_free_bytes`` or the filesystem does not keep holes.
    """
    cfg = cfg or get_preset("kimi-k3")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    if free < min_free_bytes:
        raise CheckpointError(f"only {free} bytes free, need {min_free_bytes} for headers and index", file=out_dir)
    shards = [(f, [(s.name, s.dtype, s.shape) for s in specs]) for f, specs in nm.shard_tensors(cfg)]
    total = nm.num_shards(cfg)
    if nm.has_vision_shards(cfg):
        if vision_tsv is None:
            raise CheckpointError("the full K3 layout has two vision shards; pass vision_tsv (tensors_vision.tsv)")
        vis = read_vision_tsv(vision_tsv)
        shards.append((shard_file_name(total - 1, total), [v for v in vis if v[0].startswith("mm_projector.")]))
        shards.append((shard_file_name(total, total), [v for v in vis if v[0].startswith("vision_tower.")]))
    weight_map: dict[str, str] = {}
    sizes: dict[str, int] = {}
    total_size = allocated = header_bytes = 0
    for fname, entries in shards:
        lay = shard_layout(entries)
        p = os.path.join(out_dir, fname)
        with open(p, "wb") as f:
            f.write(lay.prefix())
        os.truncate(p, lay.file_bytes)  # the payload is one hole
        allocated += os.stat(p).st_blocks * 512
        sizes[fname] = lay.file_bytes
        total_size += lay.payload_bytes
        header_bytes += lay.data_start
        weight_map.update((n, fname) for n in lay.names)
    if allocated > header_bytes + len(shards) * (1 << 20):  # block rounding only
        raise CheckpointError(f"the filesystem allocated {allocated} bytes: it does not keep sparse holes",
                              file=out_dir)
    with open(os.path.join(out_dir, INDEX_NAME), "wb") as f:
        f.write(index_json(weight_map, total_size))
    with open(os.path.join(out_dir, "config.json"), "wb") as f:
        f.write(config_json(cfg))
    return {"files": [f for f, _ in shards], "file_bytes": sizes, "total_size": total_size,
            "allocated_bytes": allocated}


__all__ = ["MIN_FREE_BYTES", "make_sparse_checkpoint", "read_vision_tsv"]
