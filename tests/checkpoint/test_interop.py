"""Checkpoints other tools write: each variant is our own export, rewritten by the safetensors library
the way another writer stores it (other float dtypes, mixed across shards; A_log as [H] or [1, 1, H, 1]; layer 0's
dense MLP under ``block_sparse_moe.`` as transformers 5 saves it; a transformers-5-style or torchtitan-style config
with extra and derived keys). Each must pass ``k3 inspect`` naming what it tolerated and give logits identical to the
canonical checkpoint's through ``k3 logits``; bad forms still exit 2."""

import json
import os
import re

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from k3jax.checkpoint.container import INDEX_NAME, SAFETENSORS_DTYPES
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.io import BYTES_READ, open_checkpoint
from k3jax.checkpoint.load import load
from k3jax.checkpoint.save import save
from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.testing import random_params

K3 = get_preset("k3-tiny")  # official K3 layout, MXFP4 experts, A_log F32 [128]
# Kimi-Linear-shaped (HF kimi-linear layout: no AttnRes, SwiGLU, softplus gate, low-rank output gate, BF16 experts,
# A_log [1, 1, H, 1], direct q_proj)
KL = K3.replace(name="kl-tiny", attn_res_block_size=None, routed_expert_hidden_size=None, latent_moe_use_norm=False,
                hidden_act="silu", kda_gate_lower_bound=None, kda_full_rank_gate=False, q_lora_rank=None,
                mla_output_gate=False, expert_format="bf16")
TOKENS = np.random.default_rng(0).integers(0, K3.vocab_size, (2, 12)).astype(np.int32)


def rewrite_as(src: str, dst: str, tensor=None, config=None, names=None) -> None:
    """Copy checkpoint ``src`` to ``dst`` through the safetensors library (its own header order, a ``format: pt``
    metadata block as torch writers add), with ``tensor(name, file, array) -> array``, ``config(dict)`` and
    ``names(name) -> [stored names]`` (one tensor under zero, one or several names; the index follows)."""
    os.makedirs(dst)
    ck = open_checkpoint(src)
    stored = {}
    for fname, hdr in ck.headers.items():
        out = {}
        for name, e in hdr.entries.items():
            a = ck.read_entry(e)
            for n in (names(name) if names else [name]):
                out[n] = np.ascontiguousarray(tensor(name, fname, a) if tensor else a)
                stored[n] = fname
        safetensors.numpy.save_file(out, os.path.join(dst, fname), metadata={"format": "pt"})
    with open(os.path.join(src, INDEX_NAME)) as f:
        idx = json.load(f)
    idx["weight_map"] = stored
    with open(os.path.join(dst, INDEX_NAME), "w") as f:
        json.dump(idx, f)  # total_size is metadata: a different payload size must not matter
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config(cfg) if config else cfg, f, indent=2)


def as_float(dtype):
    """Re-store every BF16 tensor in ``dtype`` (values exact: BF16 ⊂ F32 ⊂ F64)."""
    return lambda name, fname, a: a.astype(dtype) if a.dtype == SAFETENSORS_DTYPES["BF16"] else a


def mixed_by_shard(name, fname, a):
    """Shard k stores its floating tensors as F32 (k % 3 == 0), F64 (k % 3 == 1) or as released (BF16 / F32)."""
    k = int(fname.split("-")[1])
    if a.dtype.kind != "f" and a.dtype != SAFETENSORS_DTYPES["BF16"]:
        return a
    return a.astype(np.float32) if k % 3 == 0 else a.astype(np.float64) if k % 3 == 1 else a


def a_log(shape_of):
    def f(name, fname, a):
        if not name.endswith(".A_log"):
            return a
        v = a.reshape(-1)[:K3.kda_num_heads]
        return v.reshape(shape_of(len(v)))
    return f


def a_log_padded(name, fname, a):
    """A_log as the K3 release pads it ([128], zero tail), in a Kimi-Linear checkpoint (which stores [1, 1, H, 1])."""
    if not name.endswith(".A_log"):
        return a
    out = np.zeros(128, a.dtype)
    out[:K3.kda_num_heads] = a.reshape(-1)
    return out


def chain(*fs):
    def f(name, fname, a):
        for g in fs:
            a = g(name, fname, a)
        return a
    return f


TRANSFORMERS5_KEYS = {  # what transformers 5 / other writers add to a config; none changes the math
    "model_max_length": 1048576, "transformers_version": "5.0.0", "dtype": "float32", "use_cache": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"}, "_name_or_path": "./kimi-linear-ft",
    "head_dim": 72, "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839, "pretraining_tp": 1,
}
# and what transformers 5.23's KimiLinearConfig derives from the used keys and writes beside them (checked to agree)
DERIVED_KEYS = ["layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
                "qk_head_dim"]


def transformers5(cfg):
    lac, L = cfg["linear_attn_config"], cfg["num_hidden_layers"]
    cfg.update(TRANSFORMERS5_KEYS,
               layer_types=["full_attention" if i + 1 in lac["full_attn_layers"] else "linear_attention"
                            for i in range(L)],
               mlp_layer_types=["dense" if i < cfg["first_k_dense_replace"] else "sparse" for i in range(L)],
               linear_head_dim=lac["head_dim"], linear_num_heads=lac["num_heads"],
               linear_conv_kernel_dim=lac["short_conv_kernel_size"],
               qk_head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    return cfg


DENSE_MLP = re.compile(r"^(.*model\.layers\.\d+\.)mlp\.((gate|up|down)_proj\.weight)$")


def block_sparse_moe(name):
    """transformers 5's save_pretrained name for a dense MLP tensor (docs/model.md §13)."""
    return [DENSE_MLP.sub(r"\1block_sparse_moe.\2", name)]


def torchtitan_k3(cfg):
    """A PyTorch K3 implementation's export config: RoPE parameters of a NoPE model, its own version keys."""
    cfg["text_config"].update(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rope_theta=50000.0,
                              model_max_length=262144, transformers_version="5.0.0", dtype="float32")
    return cfg


@pytest.fixture(scope="module")
def canon(tmp_path_factory):
    """{family: (canonical dir, its k3-logits output)}."""
    root = tmp_path_factory.mktemp("interop")
    out = {}
    for fam, cfg in (("k3", K3), ("kl", KL)):
        d = str(root / f"{fam}-canon")
        save(random_params(cfg, seed=3), cfg, d)
        out[fam] = (d, k3_logits(d, root / f"{fam}-canon.npy"))
    return root, out


def k3_logits(d, out, *extra):
    tok = str(out) + ".tokens.npy"
    np.save(tok, TOKENS)
    assert main(["logits", str(d), "--tokens", tok, "--out", str(out), *extra]) == 0
    return np.load(out)


def k3_inspect(d, capsys, *extra):
    capsys.readouterr()
    rc = main(["inspect", str(d), "--json", *extra])
    return rc, capsys.readouterr()


def _bf16_count(d):
    return sum(1 for e in open_checkpoint(d).tensors.values() if e.dtype == "BF16")


VARIANTS = {
    # name: (family, tensor transform, config transform, expected "tolerated" (casts filled in below)[, names])
    "k3-f32": ("k3", as_float(np.float32), None, {"casts": "F32"}),
    "k3-mixed-shards": ("k3", mixed_by_shard, None, {"casts": "mixed"}),
    "k3-a_log-[H]": ("k3", a_log(lambda h: (h,)), None, {"a_log_form": "[H]"}),
    "k3-a_log-4d": ("k3", a_log(lambda h: (1, 1, h, 1)), None, {"a_log_form": "[1, 1, H, 1]"}),
    "k3-torchtitan": ("k3", chain(a_log(lambda h: (h,)), as_float(np.float32)), torchtitan_k3,
                      {"casts": "F32", "a_log_form": "[H]",
                       "ignored_keys": ["text_config.model_max_length", "text_config.rope_parameters",
                                        "text_config.rope_theta"]}),
    "kl-transformers5": ("kl", as_float(np.float32), transformers5,
                         {"casts": "F32", "ignored_keys": ["model_max_length", "rope_parameters", "pretraining_tp"],
                          "derived_keys": DERIVED_KEYS, "dense_mlp_names": {"block_sparse_moe": [0]}},
                         block_sparse_moe),
    "k3-dense-mlp-block_sparse_moe": ("k3", None, None, {"dense_mlp_names": {"block_sparse_moe": [0]}},
                                      block_sparse_moe),
    "kl-a_log-[H]": ("kl", a_log(lambda h: (h,)), None, {"a_log_form": "[H]"}),
    "kl-a_log-padded": ("kl", a_log_padded, None, {"a_log_form": "[128] zero-padded"}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_inspects_names_what_it_tolerated_and_gives_identical_logits(canon, variant, capsys):
    root, out = canon
    fam, tf, cf, want, *names = VARIANTS[variant]
    src, ref = out[fam]
    d = str(root / variant)
    rewrite_as(src, d, tf, cf, *names)
    rc, io = k3_inspect(d, capsys)
    assert rc == 0, io.err
    t = json.loads(io.out)["tolerated"]
    n = _bf16_count(src)
    if want.get("casts") == "F32":
        assert t["casts"] == {"F32->BF16": n}
    elif want.get("casts") == "mixed":
        assert set(t["casts"]) == {"F32->BF16", "F64->BF16", "F64->F32"} and t["casts"]["F32->BF16"] < n
    else:
        assert t["casts"] == {}
    assert t.get("a_log_form") == want.get("a_log_form")
    assert t.get("dense_mlp_names") == want.get("dense_mlp_names")
    assert t.get("derived_keys") == want.get("derived_keys")
    assert sorted(t["ignored_keys"]) == sorted(want.get("ignored_keys", [])) and t["unknown_keys"] == []
    # the human-readable report says the same
    assert main(["inspect", d]) == 0
    text = capsys.readouterr().out
    if "casts" in want:
        assert f"cast {n if want['casts'] == 'F32' else t['casts']['F32->BF16']} F32 tensors to BF16" in text
    if "a_log_form" in want:
        assert f"A_log stored {want['a_log_form']}" in text
    if "dense_mlp_names" in want:
        assert "dense MLP of layer 0 named block_sparse_moe.{gate,up,down}_proj" in text
    if "derived_keys" in want:
        assert f"derived keys (checked to agree with the keys used): {', '.join(want['derived_keys'])}" in text
    got = k3_logits(d, root / f"{variant}.npy")
    np.testing.assert_array_equal(got, ref)  # exactly: every cast is value-preserving here


def test_tolerated_is_reported_by_the_python_api_too(canon, tmp_path):
    _, out = canon
    d = str(tmp_path / "v")
    rewrite_as(out["k3"][0], d, chain(a_log(lambda h: (h,)), as_float(np.float32)), torchtitan_k3)
    stats = {}
    load(d, progress=False, stats=stats)
    assert stats["tolerated"]["a_log_form"] == "[H]" and "F32->BF16" in stats["tolerated"]["casts"]
    assert "text_config.rope_parameters" in stats["tolerated"]["ignored_keys"]


def test_canonical_checkpoint_tolerates_nothing(canon, capsys):
    _, out = canon
    for fam in ("k3", "kl"):
        rc, io = k3_inspect(out[fam][0], capsys, "--strict-config")
        assert rc == 0 and json.loads(io.out)["tolerated"] == {"unknown_keys": [], "ignored_keys": [], "casts": {}}


def with_key(cfg):
    cfg["text_config"]["mystery_knob"] = 3
    return cfg


def test_unknown_key_warns_once_and_strict_config_rejects_it(canon, tmp_path, capsys):
    _, out = canon
    d = str(tmp_path / "unknown")
    rewrite_as(out["k3"][0], d, config=with_key)
    rc, io = k3_inspect(d, capsys)
    assert rc == 0 and json.loads(io.out)["tolerated"]["unknown_keys"] == ["text_config.mystery_knob"]
    assert io.err.count("warning") == 1 and "k3 inspect: warning:" in io.err and "text_config.mystery_knob" in io.err
    for cmd in (["inspect", d, "--strict-config"],
                ["logits", d, "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "o.npy"),
                 "--strict-config"]):
        np.save(tmp_path / "t.npy", TOKENS)
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "text_config.mystery_knob" in err and "unknown" in err
        assert not os.path.exists(tmp_path / "o.npy")


@pytest.mark.parametrize("mutate,words", [
    (lambda t: t.update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (lambda t: t.update(mla_use_nope=False), "mla_use_nope"),
    (lambda t: t["quantization_config"].update(format="nvfp4-pack-quantized"), "quantization_config.format"),
], ids=["softmax-router", "rope", "nvfp4"])
def test_unsupported_math_still_exits_2(canon, tmp_path, capsys, mutate, words):
    _, out = canon
    d = str(tmp_path / "bad")

    def cf(cfg):
        mutate(cfg["text_config"])
        return cfg
    rewrite_as(out["k3"][0], d, config=cf)
    assert main(["inspect", d]) == 2
    assert words in capsys.readouterr().err


def test_nonzero_a_log_tail_exits_2_before_any_large_read(canon, tmp_path, capsys):
    _, out = canon
    d = str(tmp_path / "tail")

    def bad_tail(name, fname, a):
        if name == "language_model.model.layers.1.self_attn.A_log":
            a = np.concatenate([a[:K3.kda_num_heads], np.float32([0.0, 0.5])])  # [H + 2], last value non-zero
        return a
    rewrite_as(out["k3"][0], d, bad_tail)
    for cmd in (["inspect", d], ["logits", d, "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "o")]):
        np.save(tmp_path / "t.npy", TOKENS)
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "layers.1.self_attn.A_log" in err and "model-00002-of-000006.safetensors" in err and "exactly 0" in err
    BYTES_READ.reset()
    with pytest.raises(CheckpointError, match="must be exactly 0"):
        load(d, progress=False)
    a_log_bytes = sum(e.nbytes for n, e in open_checkpoint(d).tensors.items() if n.endswith(".A_log"))
    assert 0 < BYTES_READ.value <= a_log_bytes  # A_log leaves are read first: nothing else was


@pytest.mark.parametrize("bad,words", [
    (lambda n, a: a.astype(np.int32) if n.endswith("layers.0.input_layernorm.weight") else a,
     "dtype I32, expected a float dtype"),
    (lambda n, a: a.view(np.int8) if n.endswith("experts.0.w1.weight_packed") else a, "dtype I8, expected U8"),
    (lambda n, a: a[:, :-1] if n.endswith("experts.0.w1.weight_scale") else a, "expected [32, 1]"),
    (lambda n, a: a.astype(ml_dtypes.float8_e4m3fn) if n.endswith("layers.0.post_attention_layernorm.weight")
     else a, "dtype F8_E4M3, expected a float dtype"),
    (lambda n, a: a[:1] if n.endswith("layers.0.self_attn.A_log") else a, "A_log may also be stored"),
], ids=["int-for-float", "packed-int8", "scale-shape", "fp8-for-bf16", "short-a_log"])
def test_tolerance_opens_no_hole(canon, tmp_path, capsys, bad, words):
    _, out = canon
    d = str(tmp_path / "bad")
    rewrite_as(out["k3"][0], d, lambda n, f, a: bad(n, a))
    assert main(["inspect", d]) == 2
    assert words in capsys.readouterr().err
    BYTES_READ.reset()
    with pytest.raises(CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load(d, progress=False)
    assert BYTES_READ.value == 0  # refused at validation, before any data byte


def _dense_names(fam):
    pre = "language_model." if fam == "k3" else ""
    return [f"{pre}model.layers.0.mlp.{w}_proj.weight" for w in ("gate", "up", "down")]


@pytest.mark.parametrize("fam", ["k3", "kl"])
@pytest.mark.parametrize("case,names,words", [
    ("both", lambda n: [n, *block_sparse_moe(n)] if DENSE_MLP.match(n) else [n], "stored twice"),
    ("split", lambda n: block_sparse_moe(n) if ".gate_proj." in n and DENSE_MLP.match(n) else [n],
     "under two namings"),
])
def test_dense_mlp_under_both_names_is_refused_naming_the_layer(canon, tmp_path, capsys, fam, case, names, words):
    """Both forms in one layer (all three tensors twice, or gate under block_sparse_moe.* and up/down under mlp.*):
    which to load would be a guess, so nothing is read."""
    _, out = canon
    d = str(tmp_path / case)
    rewrite_as(out[fam][0], d, names=names)
    assert main(["inspect", d]) == 2
    err = capsys.readouterr().err
    assert "layer 0's dense MLP" in err and words in err and "block_sparse_moe.gate_proj.weight" in err
    BYTES_READ.reset()
    with pytest.raises(CheckpointError, match="layer 0's dense MLP"):
        load(d, progress=False)
    assert BYTES_READ.value == 0


def test_dense_mlp_under_block_sparse_moe_with_one_tensor_missing_names_it(canon, tmp_path, capsys):
    _, out = canon
    d = str(tmp_path / "missing")
    down = _dense_names("kl")[2]
    rewrite_as(out["kl"][0], d, names=lambda n: [] if n == down else block_sparse_moe(n))
    assert main(["inspect", d]) == 2
    err = capsys.readouterr().err
    assert "1 tensor(s) missing" in err and "'model.layers.0.block_sparse_moe.down_proj.weight'" in err


def test_moe_layer_does_not_take_a_dense_mlp_name(canon, tmp_path, capsys):
    """Only a dense layer's MLP may be stored under block_sparse_moe.{gate,up,down}_proj: on an MoE layer it is an
    unexpected tensor (the MoE block has no such weights)."""
    _, out = canon
    d = str(tmp_path / "stray")
    extra = "model.layers.1.block_sparse_moe.gate_proj.weight"
    first = _dense_names("kl")[0]
    rewrite_as(out["kl"][0], d, names=lambda n: [n, extra] if n == first else [n])
    assert main(["inspect", d]) == 2
    err = capsys.readouterr().err
    assert "1 unexpected tensor(s)" in err and extra in err
