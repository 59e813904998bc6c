"""The DSpark draft (k3jax/draft/network.py) against its float64 NumPy reference (k3jax/reference/draft.py): the
forward of ``propose`` and ``train_logits`` in float64, ``propose`` equal to ``train_logits``' block at the same
anchor, fp32 logits and gradients against the reference (central differences), and the cache's ragged appends;
then the config: ``for_target``, the HF form and its strictness, ``check_target``."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import get_preset
from k3jax.draft import DraftConfig, DraftMismatchError, DraftModel, check_target, draft_cache, target_hash
from k3jax.draft.config import spread_taps
from k3jax.errors import InputError
from k3jax.reference import draft as ref
from k3jax.testing import TOL, assert_close

TINY = get_preset("k3-tiny")
# two heads, two layers, a 3-token block: every loop of the network runs more than once
DCFG = DraftConfig.for_target(TINY, num_layers=2, num_heads=2, block_size=3)


def random_draft(dcfg, seed=0, dtype=jnp.float64, scale=4.0):
    """(graphdef of a draft computing in ``dtype``, its NumPy float64 weights): random from NumPy (no PRNG compile),
    matrices N(0, (0.02 scale)^2), gains 1 + N(0, 0.1^2), so every sublayer moves the residual and no norm gain is
    trivially one; the confidence head N(0, 1/width)."""
    gd, state = nnx.split(nnx.eval_shape(lambda: DraftModel(dcfg, dtype=jnp.float32, compute_dtype=dtype,
                                                               rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path, s):
        if jax.tree_util.keystr(path) in ("['conf_w']", "['conf_b']"):   # a logit: O(1), not a saturated sigmoid
            return rng.standard_normal(s.shape) / np.sqrt(s.shape[0])
        return 0.02 * scale * rng.standard_normal(s.shape) if len(s.shape) >= 2 else 1 + 0.1 * rng.standard_normal(
            s.shape)

    return gd, jax.tree_util.tree_map_with_path(draw, state.to_pure_dict())


def inputs(dcfg, B=2, T=11, seed=1):
    rng = np.random.default_rng(seed)
    W, D = dcfg.vocab_size, dcfg.hidden_size
    return dict(taps=rng.standard_normal((B, T, dcfg.num_target_layers, D)),
                tokens=rng.integers(0, W, (B, T)).astype(np.int32),
                embed=rng.standard_normal((W, D)), head=0.2 * rng.standard_normal((D, W)))


def cast(tree, dtype):
    return jax.tree.map(lambda a: jnp.asarray(a, dtype) if np.issubdtype(np.asarray(a).dtype, np.floating) else a,
                        tree)


def entry_points(gd):
    """Jitted (train, decode) over (params, ...) for the draft ``gd`` (a graphdef)."""

    def train(p, taps, tokens, anchors, embed, head, seg):
        return nnx.merge(gd, p).train_logits(taps, tokens, anchors, embed=embed, head=head, segment_ids=seg)

    def decode(p, taps, pieces, anchor_ids, prev, embed, head):
        m = nnx.merge(gd, p)
        cache = draft_cache(DCFG, taps.shape[0], 16, taps.dtype)
        cut = 5
        cache = m.append_context(cache, taps[:, :cut], jnp.minimum(pieces, cut))      # two ragged pieces
        cache = m.append_context(cache, taps[:, cut:], jnp.maximum(pieces - cut, 0))
        base, h = m.propose(cache, anchor_ids, embed=embed, head=head)
        return base, h, cache, base + m.markov_bias(prev), m.confidence(h, prev)

    return jax.jit(train), jax.jit(decode)


def test_train_logits_and_propose_match_reference_and_each_other(x64):
    gd, p = random_draft(DCFG)
    train, decode = entry_points(gd)
    x = inputs(DCFG)
    T, K = x["tokens"].shape[1], DCFG.block_size
    # anchors: an empty context, the last position, any order; column 1 is where the decode below drafts
    anchors = np.array([[0, 7, 10], [6, 3, 9]], np.int32)
    seg = np.array([[0] * 11, [0] * 5 + [1] * 6], np.int32)    # row 1: two documents (anchors 6, 9 in the second)
    logits, conf = train(p, x["taps"], x["tokens"], anchors, x["embed"], x["head"], seg)
    assert logits.shape == (2, 3, K, DCFG.vocab_size) and conf.shape == (2, 3, K)
    for b in range(2):
        want, want_conf = ref.train_logits_ref(p, DCFG, x["taps"][b], x["tokens"][b], anchors[b], x["embed"],
                                               x["head"], segment_ids=seg[b])
        assert_close(logits[b], want, TOL["fp64_vs_fp64"], name=f"train logits row {b}")
        assert_close(conf[b], want_conf, TOL["fp64_vs_fp64"], name=f"confidence row {b}")

    # decode: context in two ragged pieces, then one block at each row's own position P
    P = anchors[:, 1]
    anchor_ids = x["tokens"][np.arange(2), P]
    prev = np.stack([x["tokens"][b, np.minimum(P[b] + np.arange(K), T - 1)] for b in range(2)])   # tokens[P + i - 1]
    base, h, cache, biased, dconf = decode(p, x["taps"], P, anchor_ids, prev, x["embed"], x["head"])
    np.testing.assert_array_equal(cache["lengths"], P)
    assert not np.any(np.asarray(cache["layers"][0]["c_kv"])[1, 3:]), "padding positions were written"
    for b in range(2):
        want_base, want_h = ref.propose_ref(p, DCFG, x["taps"][b, :P[b]], int(anchor_ids[b]), x["embed"], x["head"])
        assert_close(base[b], want_base, TOL["fp64_vs_fp64"], name=f"propose row {b}")
        assert_close(h[b], want_h, TOL["fp64_vs_fp64"], name=f"propose h row {b}")
    # the block propose drafts IS train_logits' block at the same anchor (Markov bias and confidence included)
    assert_close(biased, logits[:, 1], TOL["fp64_vs_fp64"], name="propose vs train_logits")
    assert_close(dconf, conf[:, 1], TOL["fp64_vs_fp64"], name="confidence: propose vs train_logits")


def test_float32_gradients_and_logits_match_the_reference():
    """jax.grad of a scalar of train_logits (fp32, as a training step takes it) against central differences of the
    float64 reference, one random direction per parameter leaf; the fp32 forward against the reference too."""
    dcfg = dataclasses.replace(DCFG, num_hidden_layers=1, block_size=2)
    gd, p = random_draft(dcfg, seed=5, dtype=jnp.float32, scale=6.0)
    x = inputs(dcfg, B=1, T=7, seed=6)
    anchors = np.array([[2, 6]], np.int32)
    rng = np.random.default_rng(7)
    ct = rng.standard_normal((1, 2, dcfg.block_size, dcfg.vocab_size))
    ct_conf = rng.standard_normal((1, 2, dcfg.block_size))

    def loss(p):
        lg, cf = nnx.merge(gd, p).train_logits(*cast([x["taps"], x["tokens"], anchors], jnp.float32),
                                               embed=jnp.asarray(x["embed"], jnp.float32),
                                               head=jnp.asarray(x["head"], jnp.float32))
        return jnp.sum(lg * ct.astype(np.float32)) + jnp.sum(cf * ct_conf.astype(np.float32)), (lg, cf)

    (_, (logits, conf)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(cast(p, jnp.float32))
    want, want_conf = ref.train_logits_ref(p, dcfg, x["taps"][0], x["tokens"][0], anchors[0], x["embed"], x["head"])
    assert logits.dtype == jnp.float32
    assert_close(logits[0], want, TOL["fp32_vs_fp64"], name="fp32 train logits")
    assert_close(conf[0], want_conf, TOL["fp32_vs_fp64"], name="fp32 confidence")

    def ref_loss(q):
        lg, cf = ref.train_logits_ref(q, dcfg, x["taps"][0], x["tokens"][0], anchors[0], x["embed"], x["head"])
        return float(np.sum(lg * ct[0]) + np.sum(cf * ct_conf[0]))

    flat_p = jax.tree_util.tree_flatten_with_path(p)[0]
    flat_g = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    assert len(flat_p) == 19
    treedef = jax.tree.structure(p)
    eps = 1e-6
    for i, (path, leaf) in enumerate(flat_p):
        v = rng.standard_normal(leaf.shape)
        v /= np.linalg.norm(v)
        shifted = [[a + s * eps * v if j == i else a for j, (_, a) in enumerate(flat_p)] for s in (1, -1)]
        fd = (ref_loss(jax.tree.unflatten(treedef, shifted[0])) - ref_loss(jax.tree.unflatten(treedef, shifted[1])))
        fd /= 2 * eps
        got = float(np.sum(np.asarray(flat_g[path], np.float64) * v))
        assert_close(np.array([got]), np.array([fd]), TOL["fp32_grad"], name=f"d loss / d {jax.tree_util.keystr(path)}")


def test_append_context_in_pieces_equals_one_piece_and_drops_past_capacity():
    gd, p = random_draft(DCFG, seed=8, dtype=jnp.float32)
    append = jax.jit(lambda p, cache, taps, lengths: nnx.merge(gd, p).append_context(cache, taps, lengths))
    p = cast(p, jnp.float32)
    taps = jnp.asarray(np.random.default_rng(9).standard_normal((2, 6, DCFG.num_target_layers, DCFG.hidden_size)),
                       jnp.float32)
    lengths = jnp.array([6, 2], jnp.int32)
    whole = append(p, draft_cache(DCFG, 2, 8, jnp.float32), taps, lengths)
    parts = draft_cache(DCFG, 2, 8, jnp.float32)
    for lo in (0, 3):   # row 1 ends inside the first piece: the second piece is all padding for it
        parts = append(p, parts, taps[:, lo:lo + 3], jnp.clip(lengths - lo, 0, 3))
    np.testing.assert_array_equal(parts["lengths"], [6, 2])
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(parts)):
        assert_close(a, b, TOL["fp32_shallow"])
    assert not np.any(np.asarray(whole["layers"][1]["k_rope"])[1, 2:]), "padding positions were written"
    full = append(p, whole, taps, jnp.array([6, 6], jnp.int32))   # row 0 past the 8-slot capacity: tail dropped
    np.testing.assert_array_equal(full["lengths"], [12, 8])
    assert_close(full["layers"][1]["c_kv"][0, :6], whole["layers"][1]["c_kv"][0, :6], 0.0)
    # row 1's new tokens sit at positions 2..7: the same latents as at 0..5, the rope keys rotated further
    fresh = append(p, draft_cache(DCFG, 2, 8, jnp.float32), taps, jnp.array([6, 6], jnp.int32))
    assert_close(full["layers"][1]["c_kv"][1, 2:8], fresh["layers"][1]["c_kv"][1, :6], TOL["fp32_shallow"])
    kr_full, kr_fresh = np.asarray(full["layers"][1]["k_rope"][1, 2:8]), np.asarray(fresh["layers"][1]["k_rope"][1, :6])
    assert not np.allclose(kr_full, kr_fresh, atol=1e-3)
    assert_close(np.linalg.norm(kr_full, axis=-1), np.linalg.norm(kr_fresh, axis=-1), TOL["fp32_shallow"])
    assert full["layers"][1]["c_kv"].shape == (2, 8, DCFG.kv_lora_rank)


# ------------------------------------------------------------------------------------------------- config


def test_for_target_places_taps_like_the_published_draft():
    k3 = get_preset("kimi-k3")
    assert spread_taps(93, 5) == (2, 23, 47, 71, 89)
    assert spread_taps(5, 5) == (0, 1, 2, 3, 4)
    assert spread_taps(9, 3) == (0, 4, 8) and spread_taps(3, 3) == (0, 1, 2)
    d = DraftConfig.for_target(k3)
    assert (d.num_hidden_layers, d.num_attention_heads, d.intermediate_size, d.markov_rank) == (5, 64, 14336, 256)
    assert d.target_layer_ids == (2, 23, 47, 71, 89) and d.mask_token_id == 163837
    assert d.target_config_hash == target_hash(k3)
    check_target(d, k3)
    with pytest.raises(InputError, match="num_taps"):
        spread_taps(3, 4)


def test_hf_round_trip_and_extra_keys():
    d = DCFG
    hf = d.to_hf()
    assert hf["model_type"] == "k3_dspark" and hf["architectures"] == ["K3DSparkModel"]
    assert hf["num_target_layers"] == 5 and hf["rope_scaling"]["rope_type"] == "yarn"
    assert DraftConfig.from_hf(json.loads(json.dumps(hf))) == d
    report = {}
    got = DraftConfig.from_hf({**hf, "initializer_range": 0.02, "use_cache": True}, report=report)
    assert got == d and report["extra_keys"] == ["initializer_range", "use_cache"]
    # transformers' newer spelling: rope_parameters carrying rope_theta
    newer = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
    newer["rope_parameters"] = {**hf["rope_scaling"], "rope_theta": hf["rope_theta"]}
    assert DraftConfig.from_hf(newer) == d
    plain = DraftConfig.from_hf({**hf, "rope_scaling": None})
    assert plain.rope_scaling is None


@pytest.mark.parametrize("key,value,match", [
    ("markov_head_type", "gated", "markov_head_type"),
    ("mla_use_output_gate", True, "mla_use_output_gate"),
    ("mla_use_nope", True, "mla_use_nope"),
    ("fc_norm", True, "fc_norm"),
    ("num_target_layers", 4, "num_target_layers"),
    ("draft_vocab_size", 32000, "draft_vocab_size"),
    ("model_type", "deepseek_v3", "model_type"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_scaling"),
    ("target_layer_ids", [3, 1, 2, 0, 4], "target_layer_ids"),
    ("hidden_size", 32, "hidden_size"),
    ("mask_token_id", 97, "mask_token_id"),
    ("q_lora_rank", None, "q_lora_rank"),
], ids=lambda v: str(v)[:20])
def test_from_hf_refuses_math_it_does_not_implement(key, value, match):
    with pytest.raises(InputError, match=f"draft.json.*{match}|{match}.*draft.json"):
        DraftConfig.from_hf({**DCFG.to_hf(), key: value}, source="draft.json")


def test_check_target_names_the_field():
    check_target(DCFG, TINY)
    mini = get_preset("k3-mini")
    with pytest.raises(DraftMismatchError, match="target_hidden_size"):
        check_target(DCFG, mini)
    with pytest.raises(DraftMismatchError, match="vocab_size"):
        check_target(DCFG, TINY.replace(vocab_size=98))
    with pytest.raises(DraftMismatchError, match="target_num_hidden_layers"):
        check_target(DCFG, TINY.replace(num_layers=6, full_attn_layers=(4, 6)))
    deep = DCFG.replace(target_num_hidden_layers=9, target_layer_ids=(0, 8), target_config_hash=None)
    with pytest.raises(DraftMismatchError, match="target_layer_ids.*beyond"):
        check_target(deep, TINY)
    with pytest.raises(DraftMismatchError, match="target_config_hash"):
        check_target(DCFG, TINY.replace(situ_beta=3.0))
    check_target(DCFG.replace(target_config_hash=None), TINY.replace(situ_beta=3.0))   # no hash: shapes only
