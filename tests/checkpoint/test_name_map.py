"""The HF name map and the safetensors header layout against the official K3 tensor list (docs/checkpoint.md §11)."""

import csv
import gzip
import itertools
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.safetensors_layout import shard_file_name, shard_layout
from k3jax.config import get_preset

REPO = Path(__file__).resolve().parents[2]


def golden(name: str) -> Path:
    for p in (REPO / "tests/golden/k3" / name, REPO.parent / "shared/k3" / name):
        if p.exists():
            return p
    pytest.skip(f"{name} not found in tests/golden/k3/ nor ../shared/k3/")


@pytest.fixture(scope="module")
def k3_specs():
    return nm.hf_tensors(get_preset("kimi-k3"))


def test_k3_tensor_list_equals_official_in_order(k3_specs):
    with gzip.open(golden("tensors.tsv.gz"), "rt") as f:
        rows = [tuple(line.rstrip("\n").split("\t")) for line in f]
    assert rows[0] == ("name", "dtype", "shape")
    mine = [(s.name, s.dtype, ",".join(map(str, s.shape))) for s in k3_specs]
    assert len(mine) == len(rows) - 1 == 497_052
    assert set(mine) == set(rows[1:])
    assert mine == rows[1:]  # same on-disk order


def test_k3_totals(k3_specs):
    assert sum(s.nbytes for s in k3_specs) == 1_559_965_606_912
    assert sum(s.num_params for s in k3_specs) == 2_779_484_478_208  # docs/checkpoint.md §12.1, A_log pad included
    assert sum(s.nbytes for s in k3_specs if s.dtype == "U8") == 1_446_456_066_048
    assert Counter(s.dtype for s in k3_specs) == {"U8": 494_592, "BF16": 1_954, "F32": 506}


def test_k3_shard_headers_reproduce_published(k3_specs):
    with open(golden("shards.tsv")) as f:
        rows = {int(r["shard"]): r for r in csv.DictReader(f, delimiter="\t")}
    cfg = get_preset("kimi-k3")
    shards = nm.shard_tensors(cfg)
    assert len(shards) == 94 and nm.num_shards(cfg) == 96
    assert [s for _, specs in shards for s in specs] == k3_specs
    assert all(nm.shard_of(s.name, cfg) == k for k, (_, specs) in enumerate(shards, 1) for s in specs)
    pinned = set()
    # every size class of docs/checkpoint.md §11.5 (layer 0; KDA / MLA with 1- and 2-digit layer ids; globals); all 94
    # shards are checked through `k3 plan --shards` in tests/cli/test_plan.py
    for k in (1, 2, 4, 8, 11, 12, 93, 94):
        fname, specs = shards[k - 1]
        lay = shard_layout((s.name, s.dtype, s.shape) for s in specs)
        r = rows[k]
        assert fname == r["file"]
        assert (lay.header_len, lay.data_start, lay.payload_bytes) == (
            int(r["header_json_len_N"]), int(r["data_start"]), int(r["payload_bytes"])), fname
        assert lay.file_bytes == int(r["file_bytes_published"]), fname
        assert lay.header_sha256 == r["header_sha256_computed"], fname
        if r["header_sha256_independently_pinned"] == "yes":
            pinned.add(k)
    assert pinned == {1, 2, 4, 94}


def test_k3_byte_anchors():
    cfg = get_preset("kimi-k3")
    lay = shard_layout((s.name, s.dtype, s.shape) for s in nm.layer_tensors(cfg, 1))
    off = dict(zip(lay.names, lay.offsets))
    pre = "language_model.model.layers.1.block_sparse_moe.experts.0."
    assert lay.header_len == 818_696 and lay.data_start == 818_704
    assert off[pre + "w1.weight_packed"] == (1_267_744_256, 1_273_249_280)
    assert off[pre + "w3.weight_scale"] == (1_284_947_456, 1_285_291_520)
    # expert pages in string order of the id: 0, 1, 10, 100, ...
    first = [n.split(".experts.")[1].split(".")[0] for n in lay.names if n.endswith("w1.weight_packed")][:4]
    assert first == ["0", "1", "10", "100"]
    lay = shard_layout((s.name, s.dtype, s.shape) for s in nm.layer_tensors(cfg, 92))
    off = dict(zip(lay.names, lay.offsets))
    pre = "language_model.model.layers.92.block_sparse_moe.experts.0."
    assert lay.header_len == 823_008
    assert lay.data_start + off[pre + "w1.weight_packed"][0] == 845_158_632
    assert lay.data_start + off[pre + "w3.weight_scale"][1] - 1 == 862_705_895


def _check_coverage(cfg, specs):
    leaves = nm.leaf_shapes(cfg)
    names = [s.name for s in specs]
    assert len(names) == len(set(names)), "duplicate HF names"
    per_leaf = Counter((s.path, s.expert, s.part) for s in specs)
    assert max(per_leaf.values()) == 1, "a leaf (or expert part) mapped twice"
    mapped = {s.path for s in specs}
    assert mapped == set(leaves), (f"missing: {sorted(set(leaves) - mapped, key=str)[:5]}, "
                                   f"extra: {sorted(mapped - set(leaves), key=str)[:5]}")
    count = Counter(s.path for s in specs)
    transform = {s.path: s.transform for s in specs}
    for path, shape in leaves.items():
        parts = {"mxfp4": 2, "expert": 1}[transform[path]] * shape[0] if path[-2:-1] == ("experts",) else 1
        assert count[path] == parts, path
    return leaves


@pytest.mark.parametrize("preset,fmt", [("kimi-k3", None), ("kimi-linear-48b", None), ("k3-mini", None),
                                        ("k3-tiny", "bf16")])
def test_every_leaf_mapped_exactly_once(preset, fmt):
    cfg = get_preset(preset)
    specs = nm.hf_tensors(cfg, expert_format=fmt)
    leaves = _check_coverage(cfg, specs)
    for s in specs:  # the HF shape follows from the leaf shape through the transform
        if s.expert is None:
            assert s.shape == nm.hf_shape(s.transform, leaves[s.path], s.in_axes), s.name
    # per-shard order: F32, then BF16, then U8; byte order of names within a dtype
    shards = [list(g) for _, g in itertools.groupby(specs, key=lambda s: s.layer)]
    assert [g[0].layer for g in shards] == [*range(cfg.num_layers), None]
    for shard in shards:
        keys = [({"F32": 0, "BF16": 1, "U8": 2}[s.dtype], s.name.encode()) for s in shard]
        assert keys == sorted(keys)


def test_tiny_mxfp4_refused_with_reason():
    with pytest.raises(ValueError, match="multiple of the MXFP4 group 32"):
        nm.hf_tensors(get_preset("k3-tiny", moe_intermediate_size=24))


def test_kimi_linear_layout():
    cfg = get_preset("kimi-linear-48b")
    assert nm.default_layout(cfg) == "kimi-linear"
    by = {s.name: s for s in nm.hf_tensors(cfg)}
    assert not any(n.startswith("language_model.") for n in by)
    expect = {
        "lm_head.weight": ("BF16", (163840, 2304)),
        "model.embed_tokens.weight": ("BF16", (163840, 2304)),
        "model.norm.weight": ("BF16", (2304,)),
        "model.layers.0.mlp.gate_proj.weight": ("BF16", (9216, 2304)),
        "model.layers.0.mlp.down_proj.weight": ("BF16", (2304, 9216)),
        "model.layers.0.self_attn.A_log": ("F32", (1, 1, 32, 1)),
        "model.layers.0.self_attn.dt_bias": ("F32", (4096,)),
        "model.layers.0.self_attn.q_conv1d.weight": ("BF16", (4096, 1, 4)),
        "model.layers.0.self_attn.g_a_proj.weight": ("BF16", (128, 2304)),
        "model.layers.0.self_attn.g_b_proj.weight": ("BF16", (4096, 128)),
        "model.layers.0.self_attn.o_proj.weight": ("BF16", (2304, 4096)),
        "model.layers.3.self_attn.q_proj.weight": ("BF16", (32 * 192, 2304)),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ("BF16", (576, 2304)),
        "model.layers.3.self_attn.kv_b_proj.weight": ("BF16", (32 * 256, 512)),
        "model.layers.3.self_attn.o_proj.weight": ("BF16", (2304, 32 * 128)),
        "model.layers.26.self_attn.q_proj.weight": ("BF16", (32 * 192, 2304)),
        "model.layers.1.block_sparse_moe.gate.weight": ("BF16", (256, 2304)),
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": ("F32", (256,)),
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": ("BF16", (1024, 2304)),
        "model.layers.1.block_sparse_moe.experts.255.w1.weight": ("BF16", (1024, 2304)),
        "model.layers.1.block_sparse_moe.experts.0.w2.weight": ("BF16", (2304, 1024)),
    }
    for name, (dtype, shape) in expect.items():
        assert (by[name].dtype, by[name].shape) == (dtype, shape), name
    absent = ["model.layers.3.self_attn.g_proj.weight", "model.layers.3.self_attn.q_a_proj.weight",
              "model.layers.0.self_attn.g_proj.weight", "model.layers.1.block_sparse_moe.routed_expert_norm.weight",
              "model.output_attn_res_norm.weight", "model.layers.0.input_layernorm.weight_packed"]
    assert not any(n in by for n in absent)
    assert not any(n.endswith("_res_norm.weight") or "weight_packed" in n for n in by)
    # 20 KDA layers x (15 + 2 norms), 7 MLA x (5 + 2), dense MLP 3, 26 MoE x (router, bias, 3 shared + 3 x 256
    # experts), 3 model-level
    assert len(by) == 20 * 17 + 7 * 7 + 3 + 26 * (5 + 3 * 256) + 3 == 20_493


def test_shard_of():
    cfg = get_preset("kimi-k3")
    assert nm.shard_of("language_model.model.layers.0.mlp.up_proj.weight", cfg) == 1
    assert nm.shard_of("language_model.model.layers.92.block_sparse_moe.experts.0.w2.weight_packed", cfg) == 93
    assert nm.shard_of("language_model.lm_head.weight", cfg) == 94
    assert nm.shard_of("language_model.model.output_attn_res_proj.weight", cfg) == 94
    assert nm.shard_of("mm_projector.proj.0.weight", cfg) == 95
    assert nm.shard_of("vision_tower.encoder.blocks.0.wqkv.weight", cfg) == 96
    assert nm.shard_file_of("language_model.model.layers.1.input_layernorm.weight", cfg) == \
        "model-00002-of-000096.safetensors"
    for bad in ("language_model.model.layers.93.input_layernorm.weight", "model.norm.weight", "lm_head.weight"):
        with pytest.raises(ValueError):
            nm.shard_of(bad, cfg)
    kl = get_preset("kimi-linear-48b")
    assert nm.shard_of("model.layers.26.self_attn.o_proj.weight", kl) == 27
    assert nm.shard_of("lm_head.weight", kl) == 28 == nm.num_shards(kl)
    with pytest.raises(ValueError):
        nm.shard_of("mm_projector.proj.0.weight", kl)
    assert shard_file_name(3, 28) == "model-00003-of-000028.safetensors"


def test_linear_transform_is_head_major():
    cfg = get_preset("k3-tiny")
    specs = {s.path: s for s in nm.hf_tensors(cfg, expert_format="bf16")}
    D, N, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    x = np.arange(D * N * K, dtype=np.float32).reshape(D, N, K)
    hf = nm.leaf_to_hf(x, specs[("layers", 0, "kda", "wq")])
    assert hf.shape == (N * K, D) and hf.dtype == ml_dtypes.bfloat16
    h, j, d = 1, 5, 7
    assert float(hf[h * K + j, d]) == float(ml_dtypes.bfloat16(x[d, h, j]))
    wo = x.reshape(D, N * K).T.reshape(N, K, D)  # a [N, K, D] leaf
    hf = nm.leaf_to_hf(wo, specs[("layers", 0, "kda", "wo")])
    assert hf.shape == (D, N * K)
    assert float(hf[d, h * K + j]) == float(ml_dtypes.bfloat16(wo[h, j, d]))


def test_a_log_pad_and_tail_check():
    cfg = get_preset("kimi-k3")
    s = next(s for s in nm.layer_tensors(cfg, 0) if s.name.endswith("A_log"))
    assert (s.dtype, s.shape, s.transform) == ("F32", (128,), "a_log_pad")
    a = np.arange(1, 97, dtype=np.float32)
    hf = nm.leaf_to_hf(a, s)
    assert hf.shape == (128,) and np.all(hf[96:] == 0) and np.array_equal(hf[:96], a)
    np.testing.assert_array_equal(nm.leaf_from_hf(hf, s, (96,)), a)
    hf[100] = 1e-30
    with pytest.raises(ValueError, match="padding"):
        nm.leaf_from_hf(hf, s, (96,))
    with pytest.raises(ValueError, match="shape"):
        nm.leaf_from_hf(np.zeros(96, np.float32), s, (96,))


def _kimi_linear_tiny():
    return get_preset("k3-tiny").replace(
        attn_res_block_size=None, kda_full_rank_gate=False, kda_gate_lower_bound=None, q_lora_rank=None,
        mla_output_gate=False, routed_expert_hidden_size=None, latent_moe_use_norm=False, num_shared_experts=1,
        hidden_act="silu", expert_format="bf16")


@pytest.mark.parametrize("make", [lambda: get_preset("k3-tiny", expert_format="bf16"), _kimi_linear_tiny],
                         ids=["k3-tiny", "kimi-linear-tiny"])
def test_roundtrip_every_leaf(make):
    cfg = make()
    rng = np.random.default_rng(0)
    flat = {path: rng.standard_normal(shape).astype(np.float32) for path, shape in nm.leaf_shapes(cfg).items()}
    specs = nm.hf_tensors(cfg)
    rebuilt = {}
    for s in specs:
        leaf = flat[s.path]
        hf = nm.leaf_to_hf(leaf, s)
        assert (hf.shape, hf.dtype) == (s.shape, np.dtype(nm.np_dtype(s.dtype))), s.name
        if s.transform == "expert":
            stack = rebuilt.setdefault(s.path, np.zeros(leaf.shape, np.float32))
            stack[s.expert] = nm.leaf_from_hf(hf, s, leaf.shape[1:])
        else:
            rebuilt[s.path] = nm.leaf_from_hf(hf, s, leaf.shape)
    assert set(rebuilt) == set(flat)
    hf_dtype = {s.path: s.dtype for s in specs}
    for path, leaf in flat.items():
        dt = np.dtype(nm.np_dtype(hf_dtype[path]))
        want = leaf.astype(dt).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(rebuilt[path], np.float32), want, err_msg=str(path))


def test_a_leaf_without_an_hf_row_is_an_error_naming_block_and_leaf(monkeypatch):
    from k3jax.layers.kda import KDA

    monkeypatch.delitem(KDA.HF, "wq")  # the block still creates wq, but its table no longer names it
    cfg = get_preset("k3-tiny", expert_format="bf16").replace(name="dropped-row")  # fresh config: nothing cached
    with pytest.raises(KeyError, match=r"KDA\.HF has no entry for leaf 'wq' \(layers/0/kda/wq\)"):
        nm.hf_tensors(cfg)


def test_mxfp4_expert_helpers_match_spec_shapes():
    pytest.importorskip("k3jax.quant", reason="k3jax.quant (mxfp4_pack / mxfp4_unpack) not available")
    cfg = get_preset("k3-mini")
    specs = [s for s in nm.layer_tensors(cfg, 1) if s.path[-1] == "w2" and s.expert == 3]
    packed_spec, scale_spec = sorted(specs, key=lambda s: s.part)
    assert (packed_spec.part, scale_spec.part) == ("packed", "scale")
    E, din, dout = nm.leaf_shape(packed_spec, cfg)
    stack = np.random.default_rng(1).standard_normal((E, din, dout)).astype(np.float32)
    packed, scale = nm.expert_to_hf(stack, packed_spec)
    assert (packed.shape, scale.shape) == (packed_spec.shape, scale_spec.shape) == ((dout, din // 2), (dout, din // 32))
    assert packed.dtype == scale.dtype == np.uint8
    dense = nm.expert_from_hf(packed, scale, packed_spec)
    assert dense.shape == (din, dout)
    rel = np.sqrt(np.mean((dense - stack[3]) ** 2) / np.mean(stack[3] ** 2))
    assert rel < 0.2  # the same matrix (expert 3, [in, out]), quantized: a wrong slice or transpose gives ~1.4
    packed2, scale2 = nm.expert_to_hf(dense, packed_spec)  # re-packing a quantized matrix is lossless
    np.testing.assert_array_equal(scale2, scale)
    np.testing.assert_array_equal(nm.expert_from_hf(packed2, scale2, packed_spec), dense)
    # the bytes too, but for -0: a dequantized 0x8 is an exact -0.0, which packs as 0x0 (docs/numerics.md §10.2)
    nib = lambda q: np.stack([q & 15, q >> 4], -1)  # noqa: E731
    diff = nib(packed2) != nib(packed)
    assert (nib(packed)[diff] == 8).all() and (nib(packed2)[diff] == 0).all()
