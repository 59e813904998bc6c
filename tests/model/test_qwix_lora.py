"""qwix's LoRA provider on the NNX model (smoke test; qwix is in the ``dev`` extra, pinned in constraints-ci.txt).

How qwix 0.1.8 does LoRA (qwix/_src/providers/lora.py, model.py, utils/flax_util.py):

* ``qwix.apply_lora_to_model(model, qwix.LoraProvider([qwix.LoraRule(module_path=regex, rank, alpha)]), *inputs,
  rngs=nnx.Rngs(...))`` clones the model, swaps its class for a subclass whose ``__call__`` runs under qwix's
  interception (it patches ``jax.numpy.einsum``, ``jax.lax.dot_general``, ``jax.numpy.dot``,
  ``jax.lax.conv_general_dilated`` — ptq.py ``get_intercept_map``; NOT ``lax.ragged_dot``), tags every submodule
  with ``qwix_path`` / ``qwix_rngs`` / ``disable_quant_stats_update`` (model.py L211-216), and runs the model once.
* On each intercepted 2-operand einsum the "current module" is the nearest stack frame whose ``self`` is an
  ``nnx.Module`` (flax_util.get_current_module); a rule matches when ``re.fullmatch(module_path,
  "/".join(qwix_path))`` (qconfig.py ``_get_current_rule_and_op_id``); the rhs is a weight when it is (or traces
  back to) an ``nnx.Param`` in THAT module's ``__dict__`` (flax_util.find_param). Then it creates
  ``<name>_lora_a`` [contracting dims..., r] and ``<name>_lora_b`` [r, other rhs dims...] as ``nnx.LoRAParam``
  (a subclass of ``nnx.Param``) by ``setattr`` on the module object (flax_util.get_or_create_param), B = 0, and
  returns ``einsum + alpha / r · einsum(x, A, B)``.

So our blocks (``jnp.einsum`` on ``self.w[...]``) are picked up without any change. What works and what does not,
asserted below:

* k3-tiny (its layout has NO stacked group: all 5 layers are in ``pre``): whole-model LoRA on the KDA and MLA
  projections works — LoRA leaves appear, the forward at init equals the base logits, ``nnx.grad`` with
  ``nnx.DiffState(0, nnx.LoRAParam)`` gives gradients only to them, and an optimizer step over ``wrt=nnx.LoRAParam``
  leaves every base leaf unchanged.
* Routed experts get no LoRA: ``Experts`` has no ``__call__`` (MoE reads ``self.experts.w1[...]`` and the GEMMs run
  in k3jax.ops.grouped_matmul — ``ragged_dot`` on GPU, a scan of ``jnp.dot`` on CPU), so the current module is the
  MoE, whose own ``__dict__`` does not hold w1/w2/w3; a rule for ``.*/moe/experts`` never matches.
* The LoRA leaves inherit the base Param's metadata unchanged: our ``axes`` key is copied as is (qwix
  flax_util.update_boxed only re-derives ``out_sharding`` / ``sharding_names``), so it has the wrong length.
* The stacked layout (``nnx.vmap`` group, sliced by nnx.split/merge in ``K3Model.layers``) fails — see
  ``test_stacked_layout_fails``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

qwix = pytest.importorskip("qwix")
# qwix 0.1.8 reads nnx.Variable.value, which flax 0.12 deprecates (thousands of warnings per model call).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:qwix.*")

import optax  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.config import get_preset  # noqa: E402
from k3jax.model import K3Model  # noqa: E402
from k3jax.model.layout import layout  # noqa: E402

RANK, ALPHA = 4, 8.0
NOT_EINSUM = ("conv_q", "conv_k", "conv_v", "dt_bias")
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # LoRAParam subclasses Param: nnx.Param alone selects both


def flat(state):
    return {tuple(p): v for p, v in nnx.to_flat_state(state)}


def lora_state(model):
    return flat(nnx.state(model, nnx.LoRAParam))


def tokens(cfg, B=2, T=8, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)), jnp.int32)


def expected_lora(model, blocks):
    """{(path, name): (a shape, b shape)} for every einsum weight of the given block kinds: all Params of ndim >= 2
    except KDA's depthwise convs (k3jax.ops.kda.causal_conv_silu, not an einsum) and dt_bias [N, K] (added). The
    contracting dims are the leading ones (two for ``wo`` [N, V, D], one otherwise)."""
    out = {}
    for path, v in flat(nnx.state(model, nnx.Param)).items():
        *mod, name = path
        if not mod or mod[-1] not in blocks or v.get_value().ndim < 2 or name in NOT_EINSUM:
            continue
        shape = v.get_value().shape
        k = 2 if name == "wo" else 1
        out[(*mod, name)] = ((*shape[:k], RANK), (RANK, *shape[k:]))
    return out


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("k3-tiny")
    assert layout(cfg).groups == 0  # k3-tiny is all unstacked; the stacked case is tested separately below
    base = K3Model(cfg, rngs=nnx.Rngs(0))
    toks = tokens(cfg)
    experts_rule = qwix.LoraRule(module_path=r".*/moe/experts", rank=RANK, alpha=ALPHA)
    mixer_rule = qwix.LoraRule(module_path=r"pre/\d+/(kda|mla)", rank=RANK, alpha=ALPHA)
    provider = qwix.LoraProvider([experts_rule, mixer_rule])
    lora = qwix.apply_lora_to_model(base, provider, toks, rngs=nnx.Rngs(1))
    return dict(cfg=cfg, base=base, toks=toks, provider=provider, experts_rule=experts_rule, lora=lora)


def test_lora_params_appear_on_kda_and_mla_projections(tiny):
    base, lora = tiny["base"], tiny["lora"]
    assert not lora_state(base)  # apply_lora_to_model works on a clone
    got = lora_state(lora)
    want = expected_lora(base, ("kda", "mla"))
    assert {p[:3] for p in want} == {("pre", l, "kda") for l in (0, 1, 2)} | {("pre", l, "mla") for l in (3, 4)}
    assert len(want) == 3 * 8 + 2 * 6  # KDA: wq wk wv f_a f_b w_beta w_gate wo; MLA: q_a q_b kv_a kv_b w_gate wo
    assert set(got) == {(*p[:-1], p[-1] + s) for p in want for s in ("_lora_a", "_lora_b")}
    for p, (a_shape, b_shape) in want.items():
        a, b = got[(*p[:-1], p[-1] + "_lora_a")], got[(*p[:-1], p[-1] + "_lora_b")]
        assert a.get_value().shape == a_shape and b.get_value().shape == b_shape, p
        assert a.get_value().dtype == b.get_value().dtype == jnp.float32
        assert np.any(np.asarray(a.get_value()) != 0) and not np.any(np.asarray(b.get_value())), p  # B = 0 at init
    # The base leaves are all still there, unchanged in shape.
    assert {p: v.get_value().shape for p, v in flat(nnx.state(lora, BASE)).items()} == \
        {p: v.get_value().shape for p, v in flat(nnx.state(base, nnx.Param)).items()}

    # LIMITATION (routed experts): the experts rule never matched — Experts has no __call__, the expert GEMMs run in
    # k3jax.ops.grouped_matmul with MoE as the current module, and flax_util.find_param only looks in MoE.__dict__
    # (w1/w2/w3 live in MoE.experts). On GPU they are lax.ragged_dot, which LoraProvider does not intercept at all.
    assert [r.module_path for r in tiny["provider"].get_unused_rules()] == [tiny["experts_rule"].module_path]
    assert not [p for p in got if "moe" in p]

    # LIMITATION (metadata): qwix copies the base Param's metadata to its LoRA leaves unchanged (update_boxed
    # re-derives only 'out_sharding' / 'sharding_names'), so our logical `axes` have the base's length, not A's / B's.
    a = got[("pre", 0, "kda", "wq_lora_a")]
    assert a.get_metadata()["axes"] == ("embed", "heads", "head_dim") and a.get_value().ndim == 2


def test_forward_at_init_equals_base(tiny):
    want = tiny["base"](tiny["toks"])
    got = tiny["lora"](tiny["toks"])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # y + alpha/r · x A B with B = 0, exactly


@pytest.mark.slow
def test_grads_reach_only_lora_params(tiny):
    model = nnx.clone(tiny["lora"])
    toks = tiny["toks"]
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

    def loss_fn(m):
        logits = m(toks)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], toks[:, 1:]).mean()

    @nnx.jit
    def step(m, opt):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        opt.update(m, grads)
        return loss, grads

    base0 = {p: np.asarray(v.get_value()) for p, v in flat(nnx.state(model, BASE)).items()}
    lora0 = {p: np.asarray(v.get_value()) for p, v in lora_state(model).items()}
    loss1, g1 = step(model, opt)
    g1 = {p: np.asarray(v.get_value()) for p, v in flat(g1).items()}
    assert set(g1) == set(lora0)  # the DiffState filter differentiates the LoRA leaves only
    for p, g in g1.items():
        assert np.all(np.isfinite(g)), p
        if p[-1].endswith("_lora_b"):
            assert np.any(g != 0), p
        else:  # dL/dA = x^T (dL/dy) B^T = 0 while B = 0
            assert not np.any(g), p
    base1 = {p: np.asarray(v.get_value()) for p, v in flat(nnx.state(model, BASE)).items()}
    assert base1.keys() == base0.keys() and all(np.array_equal(base1[p], base0[p]) for p in base0)
    lora1 = {p: np.asarray(v.get_value()) for p, v in lora_state(model).items()}
    for p in lora0:
        assert np.array_equal(lora1[p], lora0[p]) != p[-1].endswith("_lora_b"), p  # only B moved in step 1
    loss2, g2 = step(model, opt)
    assert all(np.any(np.asarray(v.get_value()) != 0) for p, v in flat(g2).items())  # with B != 0, A trains too
    assert np.isfinite(float(loss2)) and float(loss2) != float(loss1)
    base2 = {p: np.asarray(v.get_value()) for p, v in flat(nnx.state(model, BASE)).items()}
    assert all(np.array_equal(base2[p], base0[p]) for p in base0)


@pytest.fixture(scope="module")
def stacked():
    """k3-tiny with 9 layers: the K3 schedule (MLA 3, 7, 8) → pre 0-3, one stacked group 4-7, post 8."""
    cfg = get_preset("k3-tiny", num_layers=9, full_attn_layers=(4, 8, 9))
    lay = layout(cfg)
    assert (lay.pre, lay.groups, lay.post) == ((0, 1, 2, 3), 1, (8,))
    return cfg, K3Model(cfg, rngs=nnx.Rngs(0))


def test_stacked_model_takes_lora_on_unstacked_blocks_but_not_inside_the_stack(stacked):
    """What whole-model qwix LoRA does with the nnx.vmap-stacked layout.

    Works (asserted): rules matching unstacked blocks (``pre/0/kda``). qwix sets ``module.qwix_rngs`` (one shared
    nnx.Rngs) on EVERY submodule (qwix/_src/model.py L216); ``K3Model.layers`` slices only the stacked Params, so
    the Rngs inside the stack is carried along unsliced and the forward runs, repeatedly.

    LIMITATION (asserted): rules matching stacked blocks. qwix creates the LoRA params lazily with ``setattr`` on
    the current module object (flax_util.get_or_create_param), which for a stacked layer is the temporary
    nnx.merge copy of one group, so they are dropped: no LoRA leaves under ``groups``, and the next call raises
    "ValueError: Cannot find rngs in the current module" (qwix_rngs is reset to None after init, model.py L226, and
    the fresh slices again lack the params). Supporting the stack needs LoRA leaves created stacked ([G, ...],
    e.g. inside the nnx.vmap that builds the group) so that slices find them by name.
    """
    cfg, model = stacked
    toks = tokens(cfg, 1, 4)
    ok = qwix.apply_lora_to_model(model, qwix.LoraProvider(module_path=r"pre/0/kda", rank=RANK, alpha=ALPHA), toks,
                                  rngs=nnx.Rngs(1))
    assert {p[:3] for p in lora_state(ok)} == {("pre", 0, "kda")}
    np.testing.assert_array_equal(np.asarray(ok(toks)), np.asarray(model(toks)))  # B = 0; and a second call runs
    every = qwix.apply_lora_to_model(model, qwix.LoraProvider(module_path=r".*/kda", rank=RANK, alpha=ALPHA), toks,
                                     rngs=nnx.Rngs(2))
    assert {p[0] for p in lora_state(every)} == {"pre"}  # the stacked KDA blocks got none
    with pytest.raises(ValueError, match="Cannot find rngs"):
        every(toks)


@pytest.mark.slow  # one compile of the 9-layer forward + LoRA gradient: ~25 s CPU alone, ~1-2 min on shared cores
def test_stacked_layout_per_block_lora_on_unstacked_layers(stacked):
    """The closest thing that works with a stack: apply qwix to each unstacked KDA / MLA block on its own (the
    stack is never tagged, so never sliced with an Rngs inside). LoRA leaves appear in pre/post only, the forward
    equals the base, and gradients through the whole model reach only them."""
    cfg, base = stacked
    run = base.run
    model = nnx.clone(base)
    x = jax.random.normal(jax.random.key(0), (1, 4, cfg.hidden_size), jnp.float32)
    for i, layer in enumerate([*model.pre, *model.post]):
        prov = qwix.LoraProvider(module_path=".*", rank=RANK, alpha=ALPHA)  # the block's own qwix path is ""
        if hasattr(layer, "kda"):
            layer.kda = qwix.apply_lora_to_model(layer.kda, prov, x, eps=cfg.rms_norm_eps, impl=run.kda_impl,
                                                 chunk_size=run.kda_chunk_size, rngs=nnx.Rngs(10 + i))
        else:
            layer.mla = qwix.apply_lora_to_model(layer.mla, prov, x, norm_eps=cfg.mla_norm_eps,
                                                 block_size=run.mla_block_size, rngs=nnx.Rngs(10 + i))
    got = lora_state(model)
    want = {p: s for p, s in expected_lora(base, ("kda", "mla")).items() if p[0] != "groups"}
    assert {p[:3] for p in want} == {("pre", 0, "kda"), ("pre", 1, "kda"), ("pre", 2, "kda"), ("pre", 3, "mla"),
                                     ("post", 0, "mla")}
    assert set(got) == {(*p[:-1], p[-1] + s) for p in want for s in ("_lora_a", "_lora_b")}

    toks = tokens(cfg, 1, 8)

    def loss_fn(m):
        logits = m(toks)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], toks[:, 1:]).mean(), logits

    @nnx.jit
    def run(m, b):
        (_, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        return logits, b(toks), grads

    logits, want_logits, grads = run(model, base)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-6, atol=1e-6)
    grads = flat(grads)
    assert set(grads) == set(got)
    assert all(np.any(np.asarray(v.get_value()) != 0) for p, v in grads.items() if p[-1].endswith("_lora_b"))
