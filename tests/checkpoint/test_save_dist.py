"""The multi-process writer (k3jax/checkpoint/save_dist.py) in one process: the same tensor ownership, per-expert
packing and gathering of leaves no device holds whole, checked byte for byte against ``save`` on a model with a
stacked layer group, float experts packed on export, experts split over ``expert`` and other leaves split over
``fsdp``. The two-process run itself: tests/checkpoint/test_release_path.py."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint import save
from k3jax.checkpoint.save_dist import _Pieces, write_shards
from k3jax.config import get_preset
from k3jax.model import init_params, layout
from k3jax.pytree import key_names
from k3jax.sharding import make_mesh

STACKED = get_preset("k3-tiny").replace(name="k3-tiny-stacked", num_layers=4, full_attn_layers=(2, 4),
                                        first_k_dense_replace=0, expert_format="mxfp4")


def _spec(path, x):
    names = key_names(path)
    lead = 1 if names[0] == "groups" else 0
    if "experts" in names:  # [(G,) E, in, out]: experts over expert
        return PartitionSpec(*([None] * lead), "expert")
    if x.ndim - lead == 2 and x.shape[-1] % 2 == 0:  # split by columns: no device holds a torch tensor whole
        return PartitionSpec(*([None] * (x.ndim - 1)), "fsdp")
    return PartitionSpec()


def test_distributed_writer_equals_save_byte_for_byte(tmp_path):
    assert layout(STACKED).groups == 2
    params = init_params(STACKED, jax.random.key(0))
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    placed = jax.tree_util.tree_map_with_path(lambda p, x: jax.device_put(x, NamedSharding(mesh, _spec(p, x))),
                                              params)
    save(jax.tree.map(np.asarray, params), STACKED, tmp_path / "ref")
    shards = list(nm.shard_tensors(STACKED, nm.default_layout(STACKED), "mxfp4"))
    pieces = _Pieces(placed, STACKED)
    pieces.gather_unheld(shards)
    assert pieces._gathered, "some leaf should need gathering (split over fsdp by columns)"
    kinds = {s.transform for _, specs in shards for s in specs}
    assert "mxfp4" in kinds
    wm, total, files = write_shards(placed, STACKED, str(tmp_path / "dist"), shards)
    assert len(files) == len(shards) and total > 0 and set(wm.values()) == set(files)
    for f in files:
        assert (tmp_path / "dist" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
