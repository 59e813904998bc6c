"""Bad checkpoints: each fails with a CheckpointError naming the file (and tensor), before anything is returned."""

import json
import os
import shutil
import struct

import numpy as np
import pytest
import safetensors.numpy

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.container import INDEX_NAME, SAFETENSORS_DTYPES
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.io import BYTES_READ, open_checkpoint
from k3jax.checkpoint.load import load
from k3jax.checkpoint.save import save
from k3jax.config import get_preset
from k3jax.testing import random_params

CFG = get_preset("k3-tiny")  # MXFP4-capable: every expert width is a multiple of the 32-wide MX block
S1, S2 = "model-00001-of-000006.safetensors", "model-00002-of-000006.safetensors"
NORM0 = "language_model.model.layers.0.input_layernorm.weight"
SCALE = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
A_LOG = "language_model.model.layers.0.self_attn.A_log"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad") / "good"
    save(random_params(CFG), CFG, d)
    return str(d)


@pytest.fixture
def ck(good, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(good, d)
    return str(d)


def rewrite(d, fname, drop=(), add=(), change=None, index=True):
    """Re-emit shard ``fname`` with tensors dropped / added ((name, dtype, array)) / changed (name -> array)."""
    ck = open_checkpoint(d)
    ents = [(e.name, e.dtype, ck.read_entry(e)) for e in ck.headers[fname].entries.values() if e.name not in drop]
    ents = [(n, dt, (change or {}).get(n, a)) for n, dt, a in ents] + list(add)
    # a replacement is stored in its own dtype (float32 -> F32, int32 -> I32, ...); raw uint16 bits stay BF16
    ents = [(n, _st_dtype(a, dt), np.asarray(a)) for n, dt, a in ents]
    # written by the safetensors library (any dtype; the header order is its own, which the reader must accept)
    safetensors.numpy.save_file({n: np.ascontiguousarray(a).view(SAFETENSORS_DTYPES[dt]) for n, dt, a in ents},
                                os.path.join(d, fname))
    if index:
        p = os.path.join(d, INDEX_NAME)
        idx = json.load(open(p))
        for n in drop:
            idx["weight_map"].pop(n, None)
        for n, _, _ in add:
            idx["weight_map"][n] = fname
        json.dump(idx, open(p, "w"))


def _st_dtype(a, dt):
    a = np.asarray(a)
    if a.dtype == SAFETENSORS_DTYPES[dt] or (dt == "BF16" and a.dtype == np.uint16):
        return dt
    return next(k for k, v in SAFETENSORS_DTYPES.items() if v == a.dtype)


def raw_shard(path, header_bytes, payload=b""):
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes + payload)


def fails(d, *words, cfg=CFG):
    BYTES_READ.reset()
    with pytest.raises(CheckpointError) as ei:
        load(d, cfg=cfg, progress=False)
    msg = str(ei.value)
    for w in words:
        assert w in msg, msg
    return msg


def test_good_checkpoint_loads(good):
    _, p = load(good, cfg=CFG, progress=False)
    assert p["pre"][1]["moe"]["experts"]["w2"].shape == (8, 32, 32)


def test_truncated_shard(ck):
    p = os.path.join(ck, S2)
    os.truncate(p, os.path.getsize(p) - 5)
    msg = fails(ck, S2, "truncated")
    assert "tensor 'language_model.model.layers.1.block_sparse_moe.experts." in msg and BYTES_READ.value == 0


def test_header_length_past_eof(ck):
    p = os.path.join(ck, S1)
    with open(p, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(p)))
    fails(ck, S1, "runs past the end of the file")


def test_file_shorter_than_length_prefix(ck):
    os.truncate(os.path.join(ck, S1), 5)
    fails(ck, S1, "truncated shard: 5 bytes")


def test_header_not_json(tmp_path):
    raw_shard(tmp_path / "model.safetensors", b'{"a": [1, 2' + b" " * 5)
    with pytest.raises(CheckpointError, match="model.safetensors: header is not valid UTF-8 JSON"):
        open_checkpoint(tmp_path)


def test_header_not_object(tmp_path):
    raw_shard(tmp_path / "model.safetensors", b"[1, 2]  ")
    with pytest.raises(CheckpointError, match="model.safetensors: header must be a JSON object, got list"):
        open_checkpoint(tmp_path)


def _hdr(**entries):
    return json.dumps(entries).encode()


def test_overlapping_offsets(tmp_path):
    h = _hdr(a={"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             b={"dtype": "F32", "shape": [2], "data_offsets": [4, 12]})
    raw_shard(tmp_path / "x.safetensors", h, b"\0" * 12)
    with pytest.raises(CheckpointError, match=r"x.safetensors: tensor 'b': data of 'b' .* overlaps 'a'"):
        open_checkpoint(tmp_path)


def test_offsets_out_of_range(tmp_path):
    h = _hdr(a={"dtype": "U8", "shape": [8], "data_offsets": [4, 12]})
    raw_shard(tmp_path / "x.safetensors", h, b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"x.safetensors: tensor 'a': data_offsets \[4, 12\] run past"):
        open_checkpoint(tmp_path)


def test_unknown_dtype(tmp_path):
    raw_shard(tmp_path / "x.safetensors", _hdr(a={"dtype": "Q3", "shape": [1], "data_offsets": [0, 1]}), b"\0")
    with pytest.raises(CheckpointError, match="x.safetensors: tensor 'a': unknown dtype 'Q3'"):
        open_checkpoint(tmp_path)


def test_dtype_inconsistent_with_byte_length(tmp_path):
    raw_shard(tmp_path / "x.safetensors", _hdr(a={"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}), b"\0" * 8)
    with pytest.raises(CheckpointError, match="x.safetensors: tensor 'a': dtype F32 and shape .* need 12 bytes"):
        open_checkpoint(tmp_path)


def test_f8_e8m0_and_bf16_are_readable(tmp_path):
    """What the safetensors library cannot return (docs/numerics.md §14.5) our reader views with ml_dtypes."""
    h = _hdr(s={"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]},
             w={"dtype": "F8_E4M3", "shape": [2], "data_offsets": [2, 4]})
    raw_shard(tmp_path / "x.safetensors", h, bytes([127, 130, 0x38, 0xC0]))
    ck = open_checkpoint(tmp_path)
    np.testing.assert_array_equal(ck.read("s").astype(np.float32), [1.0, 8.0])
    np.testing.assert_array_equal(ck.read("w").astype(np.float32), [1.0, -2.0])


def test_missing_tensor(ck):
    rewrite(ck, S1, drop=[NORM0])
    fails(ck, "1 tensor(s) missing", repr(NORM0), f"expected in {S1}")
    assert BYTES_READ.value == 0  # validation happens before any data read


def test_extra_tensor(ck):
    rewrite(ck, S2, add=[("language_model.model.layers.1.self_attn.bogus", "BF16", np.zeros(3, np.uint16))])
    fails(ck, "1 unexpected tensor(s)", "'language_model.model.layers.1.self_attn.bogus' in " + S2)


def test_shape_mismatch(ck):
    rewrite(ck, S1, change={NORM0: np.zeros(65, np.uint16)})
    fails(ck, S1, NORM0, "shape [65], expected [64]")


def test_integer_where_a_float_is_expected(ck):
    rewrite(ck, S1, change={NORM0: np.zeros(64, np.int32)})
    fails(ck, S1, NORM0, "dtype I32, expected a float dtype (BF16 in the k3 layout)")
    assert BYTES_READ.value == 0


PACKED = SCALE.replace("weight_scale", "weight_packed")


@pytest.mark.parametrize("value,words", [
    (np.zeros((32, 16), np.int8), "dtype I8, expected U8"),
    (np.zeros((32, 17), np.uint8), "shape [32, 17], expected [32, 16]"),
    (np.zeros((32, 16), np.float32), "dtype F32, expected U8"),
], ids=["int8", "shape", "float"])
def test_packed_bytes_must_match_exactly(ck, value, words):
    assert open_checkpoint(ck).tensors[PACKED].shape == (32, 16)
    rewrite(ck, S2, change={PACKED: value})
    fails(ck, S2, PACKED, words)


@pytest.mark.parametrize("with_index", [True, False], ids=["index", "no-index"])
def test_duplicate_name_across_shards(ck, with_index):
    if not with_index:
        os.remove(os.path.join(ck, INDEX_NAME))
    rewrite(ck, S2, add=[(NORM0, "BF16", np.zeros(64, np.uint16))], index=False)
    fails(ck, "appears in two shards", S1, S2, NORM0)


def test_header_tensor_not_in_index(ck):
    rewrite(ck, S2, add=[("language_model.model.layers.1.self_attn.bogus", "BF16", np.zeros(3, np.uint16))],
            index=False)
    fails(ck, S2, "bogus", "the index does not list it")


@pytest.mark.parametrize("target,words", [
    ("model-00099-of-000006.safetensors", "does not exist"),
    ("../" + S1, "outside the checkpoint directory"),
    ("/etc/passwd", "outside the checkpoint directory"),
    ("pytorch_model.bin", "pickle-based"),
], ids=["missing-file", "dotdot", "absolute", "pickle"])
def test_bad_index_entry(ck, target, words):
    p = os.path.join(ck, INDEX_NAME)
    idx = json.load(open(p))
    idx["weight_map"][NORM0] = target
    json.dump(idx, open(p, "w"))
    fails(ck, INDEX_NAME, NORM0, words)


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not-unpickled")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*never unpickles"):
        open_checkpoint(tmp_path)


def test_nan_scale_byte(ck):
    a = open_checkpoint(ck).read(SCALE).copy()
    a[2, 0] = 0xFF
    rewrite(ck, S2, change={SCALE: a})
    fails(ck, S2, SCALE, "1 E8M0 scale byte(s) are 0xFF (NaN)")


def test_a_log_nonzero_tail(ck):
    a = open_checkpoint(ck).read(A_LOG).copy()
    assert a.shape == (128,) and not a[2:].any()
    a[100] = 1.0
    rewrite(ck, S1, change={A_LOG: a})
    fails(ck, S1, A_LOG, "must be exactly 0")


def test_name_map_shard_rule_matches_files(good):
    """Sanity for the fixtures above: the files are where the name map says."""
    ck = open_checkpoint(good)
    assert ck.tensors[NORM0].file == S1 == nm.shard_file_of(NORM0, CFG)
    assert ck.tensors[SCALE].file == S2
