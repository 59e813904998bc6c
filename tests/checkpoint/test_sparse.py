"""Full-scale dry run on the sparse 96-file K3 layout: real headers and index, holes for the 1.56 TB of data."""

import csv
import hashlib
import os
import shutil

import numpy as np
import pytest

from k3jax.checkpoint.io import open_checkpoint
from k3jax.checkpoint.leaves import LeafSource
from k3jax.checkpoint.plan import plan_load
from k3jax.checkpoint.sparse import MIN_FREE_BYTES, make_sparse_checkpoint
from k3jax.config import get_preset

K3 = os.path.join(os.path.dirname(__file__), "..", "golden", "k3")  # the release's layout metadata
PAGE = 17_547_264  # one expert's six tensors (docs/numerics.md §10.4)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(os.path.join(K3, "shards.tsv")), reason="needs tests/golden/k3 layout data"),
]


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    d = tmp_path_factory.mktemp("sparse")
    if shutil.disk_usage(d).free < MIN_FREE_BYTES:
        pytest.skip("not enough free disk for the headers and the index")
    info = make_sparse_checkpoint(d / "k3", vision_tsv=os.path.join(K3, "tensors_vision.tsv"))
    return str(d / "k3"), info


def test_sparse_layout_reproduces_published_files(sparse):
    d, info = sparse
    rows = list(csv.DictReader(open(os.path.join(K3, "shards.tsv")), delimiter="\t"))
    assert info["files"] == [r["file"] for r in rows] and len(rows) == 96
    for r in rows:
        p = os.path.join(d, r["file"])
        assert os.path.getsize(p) == int(r["file_bytes_published"]), r["file"]
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            assert n == int(r["header_json_len_N"])
            assert hashlib.sha256(f.read(n)).hexdigest() == r["header_sha256_computed"], r["file"]
    assert info["total_size"] == 1_560_860_324_864
    assert info["allocated_bytes"] < 200 << 20  # holes: ~76 MB of headers on disk for 1.45 TiB of files


def test_open_validate_and_read_one_devices_eighth_of_layer1_experts(sparse):
    d, _ = sparse
    ck = open_checkpoint(d)
    assert len(ck.tensors) == 497_052 and ck.total_size == 1_560_860_324_864
    plan = plan_load(ck, get_preset("kimi-k3"))
    # byte anchors of docs/checkpoint.md §11.6 and the string order of expert ids on disk
    pages = ck.expert_pages("language_model.model.layers.1.block_sparse_moe")
    assert pages[0] == ("model-00002-of-000096.safetensors", 818_704 + 1_267_744_256, 818_704 + 1_285_291_520)
    order = sorted(pages, key=lambda e: pages[e][1])
    assert order[:5] == [0, 1, 10, 100, 101] and order == sorted(range(896), key=str)
    assert all(pages[e][2] - pages[e][1] == PAGE for e in pages)
    assert ck.expert_pages("language_model.model.layers.92.block_sparse_moe")[0][1:] == (845_158_632, 862_705_896)

    # device 0 of an 8-way expert axis: experts [0, 112) of layer 1, all six packed parts, read by the load callback
    before = ck.bytes_read
    for w in ("w1", "w2", "w3"):
        path = ("layers", 1, "moe", "experts", w)
        for kind in ("packed", "scale"):
            spec = next(s for s, _ in plan.leaves[path] if s.part == kind)
            src = LeafSource(ck, plan, path, (896, *spec.shape), np.uint8, kind)
            a = src((slice(0, 112), slice(None), slice(None)))
            assert a.shape == (112, *spec.shape) and not a[:, :4].any()  # holes read as zeros
            del a, src
    got = ck.bytes_read - before
    layer_expert_bytes = 896 * PAGE
    assert abs(got / (layer_expert_bytes / 8) - 1) < 0.05, (got, layer_expert_bytes / 8)
    assert got == 112 * PAGE  # exactly this device's experts, nothing else
