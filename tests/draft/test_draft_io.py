"""A draft's files (k3jax/draft/io.py): the published DSpark tensor layout, save/load round trips, and the loader's
strictness — the target identity checked before any weight is read, every unknown / missing / misshapen tensor an
InputError naming the file and the tensor, target copies accepted and reported."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from k3jax.config import get_preset
from k3jax.draft import DraftConfig, DraftMismatchError, DraftModel, draft_tensor_shapes, load_draft, save_draft
from k3jax.errors import InputError

TINY = get_preset("k3-tiny")
DCFG = DraftConfig.for_target(TINY, num_layers=2, num_heads=2)


def random_model(dcfg, seed=0):
    gd, state = nnx.split(nnx.eval_shape(lambda: DraftModel(dcfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    return nnx.merge(gd, jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), jnp.float32),
                                      state.to_pure_dict()))


def params(model):
    return nnx.state(model, nnx.Param).to_pure_dict()


def test_published_layout_names_shapes_and_count():
    k3 = get_preset("kimi-k3")
    d = DraftConfig.for_target(k3, num_layers=5, num_heads=64, intermediate_size=14336, markov_rank=256,
                               mask_token_id=163837)
    assert d.target_layer_ids == (2, 23, 47, 71, 89)
    shapes = draft_tensor_shapes(d, embed=True)
    D, W, n = 7168, 163840, 5
    want = {"context_proj.weight": (D, n * D), "context_norm.weight": (D,), "final_norm.weight": (D,),
            "markov_head.markov_w1.weight": (W, 256), "markov_head.markov_w2.weight": (W, 256),
            "confidence_head.proj.weight": (1, D + 256), "confidence_head.proj.bias": (1,),
            "embed_tokens.weight": (W, D)}
    for i in range(5):
        p = f"layers.{i}."
        want.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                     p + "self_attn.q_a_proj.weight": (1536, D), p + "self_attn.q_a_layernorm.weight": (1536,),
                     p + "self_attn.q_b_proj.weight": (64 * 192, 1536),
                     p + "self_attn.kv_a_proj_with_mqa.weight": (576, D),
                     p + "self_attn.kv_a_layernorm.weight": (512,), p + "self_attn.kv_b_proj.weight": (64 * 256, 512),
                     p + "self_attn.o_proj.weight": (D, 64 * 128), p + "mlp.gate_proj.weight": (14336, D),
                     p + "mlp.up_proj.weight": (14336, D), p + "mlp.down_proj.weight": (D, 14336)})
    assert shapes == want
    assert len(shapes) == 68
    assert sum(int(np.prod(s)) for s in shapes.values()) == 3_562_312_961      # ~3.56 B with embed_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, dtype):
    model = random_model(DCFG)
    embed = np.random.default_rng(1).standard_normal((DCFG.vocab_size, DCFG.hidden_size)).astype(np.float32)
    out = save_draft(tmp_path / "d", model, DCFG, dtype=dtype, embed=embed)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == dtype
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert set(tensors) == set(draft_tensor_shapes(DCFG, embed=True))
    w = np.asarray(params(model)["layers"][1]["attn"]["q_b"])                 # [Rq, N, H] ← torch [N*H, Rq]
    np.testing.assert_array_equal(tensors["layers.1.self_attn.q_b_proj.weight"].astype(np.float32),
                                  w.reshape(w.shape[0], -1).T.astype(tensors["final_norm.weight"].dtype))
    report = {}
    loaded, dcfg = load_draft(out, target_cfg=TINY, report=report)
    assert dcfg == DCFG and report["ignored"] == ["embed_tokens.weight"] and report["extra_keys"] == []
    round_to = (lambda a: a) if dtype == "float32" else (lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32))
    for a, b in zip(jax.tree.leaves(params(loaded)), jax.tree.leaves(params(model))):
        np.testing.assert_array_equal(np.asarray(a), round_to(np.asarray(b)))


def test_identity_is_checked_before_any_weight(tmp_path):
    out = save_draft(tmp_path / "d", random_model(DCFG), DCFG, dtype="float32")
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(DraftMismatchError, match="target_config_hash"):
        load_draft(out, target_cfg=TINY.replace(situ_beta=3.0))
    with pytest.raises(DraftMismatchError, match="vocab_size"):
        load_draft(out, target_cfg=TINY.replace(vocab_size=101))
    with pytest.raises(InputError, match="model.safetensors.*not a readable"):
        load_draft(out, target_cfg=TINY)


def _rewrite(out, edit):
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return path


@pytest.mark.parametrize("case", ["unknown", "missing", "shape", "dtype"])
def test_bad_tensors_are_named(tmp_path, case):
    out = save_draft(tmp_path / "d", random_model(DCFG), DCFG, dtype="float32")
    name = "layers.1.self_attn.kv_b_proj.weight"
    edits = {
        "unknown": lambda t: t.update({"layers.2.mlp.up_proj.weight": t["layers.1.mlp.up_proj.weight"]}),
        "missing": lambda t: t.pop(name),
        "shape": lambda t: t.update({name: t[name][:-1]}),
        "dtype": lambda t: t.update({name: t[name].astype(np.int32)}),
    }
    path = _rewrite(out, edits[case])
    bad = "layers.2.mlp.up_proj.weight" if case == "unknown" else name
    where = "d: draft tensor" if case == "missing" else f"{path}: tensor"
    with pytest.raises(InputError, match=f"{where} {bad}"):
        load_draft(out, target_cfg=TINY)


def test_config_errors_name_the_file(tmp_path):
    out = save_draft(tmp_path / "d", random_model(DCFG), DCFG)
    cfg_path = os.path.join(out, "config.json")
    hf = json.load(open(cfg_path))
    json.dump({**hf, "markov_head_type": "gated", "foo": 1}, open(cfg_path, "w"))
    with pytest.raises(InputError, match="config.json: markov_head_type"):
        load_draft(out, target_cfg=TINY)
    os.remove(cfg_path)
    with pytest.raises(InputError, match="config.json: no draft config"):
        load_draft(out, target_cfg=TINY)
    with pytest.raises(InputError, match="not empty"):
        save_draft(out, random_model(DCFG), DCFG)
