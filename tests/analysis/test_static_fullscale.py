"""Static router analysis on the full-scale 96-file K3 layout (sparse files): it reads exactly the 92 layers'
router and bias payloads plus the headers of the 92 shards holding them, out of 1.56 TB."""

import os
import shutil

import pytest

from k3jax.analysis.static import static_router_analysis
from k3jax.checkpoint.container import read_header
from k3jax.checkpoint.sparse import MIN_FREE_BYTES, make_sparse_checkpoint

K3 = os.path.join(os.path.dirname(__file__), "..", "golden", "k3")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(os.path.join(K3, "tensors_vision.tsv")), reason="needs tests/golden/k3"),
]


def test_static_analysis_of_the_full_release_layout_reads_only_router_bytes(tmp_path):
    if shutil.disk_usage(tmp_path).free < MIN_FREE_BYTES:
        pytest.skip("not enough free disk for the headers and the index")
    d = tmp_path / "k3"
    info = make_sparse_checkpoint(d, vision_tsv=os.path.join(K3, "tensors_vision.tsv"))
    r = static_router_analysis(str(d))
    assert len(r["layers"]) == 92 and r["layers"][0]["layer"] == 1 and r["layers"][-1]["layer"] == 92
    assert r["bytes_read"] == 92 * (12_845_056 + 3_584) == 1_182_074_880
    assert r["shards_touched"] == 92
    want_headers = sum(8 + read_header(os.path.join(d, f"model-{k:05d}-of-000096.safetensors")).header_len
                       for k in range(2, 94))
    assert r["header_bytes"] == want_headers
    print(f"static analysis: {r['bytes_read']:,} tensor bytes + {r['header_bytes']:,} header bytes from "
          f"{r['shards_touched']} shards, of {info['total_size']:,} payload bytes")
