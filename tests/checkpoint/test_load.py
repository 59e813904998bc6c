"""Round trips: params → save → load (bit-exact against the storage-rounded values), save → load → save byte-identical,
per-device byte accounting of the sharded load."""

import filecmp
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.io import open_checkpoint
from k3jax.checkpoint.load import load
from k3jax.checkpoint.plan import plan_load
from k3jax.checkpoint.save import save
from k3jax.config import from_hf, get_preset
from k3jax.ops import mx
from k3jax.pytree import key_names
from k3jax.quant.host import mxfp4_dequantize_np
from k3jax.sharding.mesh import make_mesh


def random_params(cfg, seed, dtype="float32"):
    """Random values in the params tree of ``cfg`` (numpy: eager ``init_params`` takes ~15 s on the shared CPU)."""
    from k3jax.config import RunConfig
    from k3jax.model import abstract_params

    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype),
                        abstract_params(cfg, RunConfig(param_dtype=dtype)))


def _flat(tree, cfg):
    """{per-layer-view path: host array}: the state's stacked leaves sliced per layer (the name map's addresses)."""
    from k3jax.model import unstack

    flat, _ = jax.tree_util.tree_flatten_with_path(unstack(tree, cfg))
    return {key_names(kp): np.asarray(v) for kp, v in flat}


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def expected_after_storage(params, cfg, fmt):
    """What a lossless export stores: BF16 tensors rounded to bf16, MXFP4 experts fake-quantized ("even" rule)."""
    specs = {}
    for s in nm.hf_tensors(cfg, expert_format=fmt):
        specs.setdefault(s.path, s)
    out = {}
    for path, v in _flat(params, cfg).items():
        s = specs[path]
        if s.transform == "mxfp4":
            out[path] = np.asarray(mx.fake_quant_mxfp4(jax.numpy.asarray(v), axis=1)).astype(v.dtype)
        elif s.dtype == "BF16":
            out[path] = v.astype(ml_dtypes.bfloat16).astype(v.dtype)
        else:
            out[path] = v
    return out


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    cfg = get_preset("k3-mini")
    params = random_params(cfg, 0)
    d = tmp_path_factory.mktemp("ck") / "mini"
    save(params, cfg, d)
    return cfg, params, str(d)


def test_mini_roundtrip_is_bit_exact_against_storage_rounding(mini):
    cfg, params, d = mini
    stats = {}
    cfg2, loaded = load(d, progress=False, stats=stats)
    assert nm.default_layout(cfg2) == "k3" and cfg2.num_experts == cfg.num_experts
    want = expected_after_storage(params, cfg, "mxfp4")
    got = _flat(loaded, cfg)
    assert got.keys() == want.keys()
    for path in want:
        assert got[path].dtype == want[path].dtype, path
        np.testing.assert_array_equal(_bits(got[path]), _bits(want[path]), err_msg=str(path))
    # every payload byte read exactly once, although replicated leaves have 8 device copies
    assert stats["bytes_read"] == stats["checkpoint_bytes"] == open_checkpoint(d).total_size
    assert stats["scale_bytes"]["0xFF"] == 0 and stats["packed_modules"] == 3 * 32 * 8


def test_save_load_save_is_byte_identical_and_layout_is_official(mini, tmp_path):
    cfg, _, d = mini
    cfg2, loaded = load(d, progress=False)
    save(loaded, cfg2, tmp_path / "again")
    names = sorted(os.listdir(d))
    assert names == sorted(os.listdir(tmp_path / "again"))
    assert [n for n in names if n.endswith(".safetensors")] == [f"model-{k:05d}-of-000010.safetensors"
                                                                for k in range(1, 11)]
    # Byte-identical, except that a dequantized -0 (code 0x8, a small negative weight) is re-quantized as an exact
    # -0.0, which compressed-tensors' rule stores as 0x0 (docs/numerics.md §10.2): same values; the keep-packed
    # re-export below is byte-identical everywhere.
    a, b = open_checkpoint(d), open_checkpoint(tmp_path / "again")
    changed_nibbles = 0
    for n in names:
        if filecmp.cmp(os.path.join(d, n), tmp_path / "again" / n, shallow=False):
            continue
        assert n.endswith(".safetensors") and a.headers[n].header_len == b.headers[n].header_len, n
        for name, e in a.headers[n].entries.items():
            x, y = a.read_entry(e), b.read(name)
            if name.endswith(".weight_packed"):
                nib = lambda q: np.stack([q & 15, q >> 4], -1)  # noqa: E731
                diff = nib(x) != nib(y)
                assert (nib(x)[diff] == 8).all() and (nib(y)[diff] == 0).all(), name
                changed_nibbles += int(diff.sum())
            else:
                np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=name)
    assert changed_nibbles > 0  # random weights of std 0.02 do have negatives that round to 0
    raw = open(os.path.join(d, "model.safetensors.index.json"), "rb").read()
    assert raw.startswith(b'{\n  "metadata": {\n    "total_size": ') and not raw.endswith(b"\n")
    assert not any(".tmp-" in n for n in os.listdir(os.path.dirname(d)))
    c = from_hf(os.path.join(d, "config.json"))
    assert c.expert_format == "mxfp4" and c.full_attn_layers == cfg.full_attn_layers


def test_keep_packed_returns_disk_bytes_and_saves_identically(mini, tmp_path):
    cfg, _, d = mini
    ck = open_checkpoint(d)
    _, packed = load(d, keep_experts_packed=True, progress=False)
    ex = packed["pre"][1]["moe"]["experts"]
    assert set(ex) == {"w1_packed", "w1_scale", "w2_packed", "w2_scale", "w3_packed", "w3_scale"}
    assert ex["w2_packed"].dtype == np.uint8 and ex["w2_packed"].shape == (32, 192, 80)
    e7 = ck.read("language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight_packed")
    np.testing.assert_array_equal(np.asarray(ex["w2_packed"])[7], e7)
    save(packed, cfg, tmp_path / "p")
    for n in os.listdir(d):
        assert filecmp.cmp(os.path.join(d, n), tmp_path / "p" / n, shallow=False), n


def test_host_dequantize_matches_mx_ops():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (5, 16), dtype=np.uint8)
    scale = rng.integers(100, 150, (5, 1), dtype=np.uint8)
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(5, 32)
    want = np.asarray(mx.mxfp4_dequantize(codes, scale, axis=-1))
    np.testing.assert_array_equal(_bits(mxfp4_dequantize_np(packed, scale)), _bits(want))


def test_expert_sharded_load_reads_only_each_shard_once(mini):
    """On a (data 2, expert 4) mesh each expert quarter is read once (memoized across its 2 replicas)."""
    cfg, _, d = mini
    mesh = make_mesh({"data": 2, "expert": 4})
    stats = {}
    _, p = load(d, mesh=mesh, progress=False, stats=stats)
    w1 = p["pre"][2]["moe"]["experts"]["w1"]
    assert w1.sharding.spec == jax.sharding.PartitionSpec("expert")
    shard_rows = {s.index[0].start for s in w1.addressable_shards}
    assert shard_rows == {0, 8, 16, 24}
    assert stats["bytes_read"] == stats["checkpoint_bytes"]


def test_tiny_bf16_experts_roundtrip(tmp_path):
    cfg = get_preset("k3-tiny", expert_format="bf16")
    params = random_params(cfg, 1, dtype="bfloat16")
    save(params, cfg, tmp_path / "t")
    ck = open_checkpoint(tmp_path / "t")
    assert not ck.packed_modules()
    plan = plan_load(ck, cfg)
    assert not any(plan.packed.values())
    _, got = load(tmp_path / "t", cfg=cfg, dtype="bfloat16", progress=False)
    for path, v in _flat(params, cfg).items():
        np.testing.assert_array_equal(_bits(_flat(got, cfg)[path]), _bits(v), err_msg=str(path))
    save(got, cfg, tmp_path / "t2")
    for n in os.listdir(tmp_path / "t"):
        assert filecmp.cmp(tmp_path / "t" / n, tmp_path / "t2" / n, shallow=False), n
