"""The functional face of ``K3Model``: plain pytrees in, plain pytrees out, so ``jax.jit``, ``grad``,
``eval_shape``, shardings, optax and orbax work on the parameter state as on any pytree.

    params = init_params(cfg, jax.random.key(0))      # nnx.split(K3Model(...)) state as a nested dict of arrays
    logits = forward(params, tokens, cfg)             # nnx.merge(graphdef(cfg), params)(tokens)
    logits = forward(params, tokens, cfg, RunConfig(compute_dtype="bfloat16", qat="weights"))   # run settings
    logits = forward(packed, tokens, cfg)             # experts as MXFP4 bytes (load(..., keep_experts_packed=True))
    shapes = abstract_params(cfg)                     # ShapeDtypeStructs; allocates nothing (full 2.78T model too)
    axes   = param_axes(cfg)                          # logical axes per leaf, read from the Params' metadata
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import optax
from flax import nnx

from k3jax.config import LORA_TARGETS, K3Config, LoRAConfig, RunConfig, default_run
from k3jax.layers.experts import holds_packed
from k3jax.layers.mla import MLADims
from k3jax.model.network import K3Model


def _run(cfg: K3Config, run: RunConfig | None) -> RunConfig:
    return default_run(cfg) if run is None else run


def abstract_model(cfg: K3Config, run: RunConfig | None = None) -> K3Model:
    """``K3Model`` with ShapeDtypeStruct leaves (``nnx.eval_shape``: no memory, no mesh)."""
    return nnx.eval_shape(lambda: K3Model(cfg, _run(cfg, run), rngs=nnx.Rngs(0)))


@functools.lru_cache(maxsize=16)
def _abstract(cfg: K3Config, run: RunConfig, packed_experts: tuple = ()):
    model = abstract_model(cfg, run)
    for path in packed_experts:
        node = model
        for key in path:
            node = node[key] if isinstance(key, int) else getattr(node, key)
        node.to_packed()
    return nnx.split(model)


def packed_expert_paths(params) -> tuple:
    """State paths of the ``experts`` dicts that hold their stacks packed (``w1_packed``, ``w1_scale``, … as
    ``load(..., keep_experts_packed=True)`` returns them; ``k3jax.layers.moe.Experts.to_packed``)."""
    out = []

    def walk(node, path):
        if holds_packed(node):
            out.append(path)
            return
        for k, v in node.items():
            if hasattr(v, "items"):
                walk(v, (*path, k))

    walk(params, ())
    return tuple(out)


def graphdef(cfg: K3Config, run: RunConfig | None = None, packed_experts: tuple = ()):
    """The static structure of ``K3Model(cfg, run)``, with the experts at ``packed_experts`` (state paths) in packed
    form (cached per config, run settings and packed paths)."""
    return _abstract(cfg, _run(cfg, run), tuple(packed_experts))[0]


def init_params(cfg: K3Config, key, run: RunConfig | None = None) -> dict:
    """Random parameters for ``cfg`` (dtype ``run.param_dtype``) as a nested dict. Use ``abstract_params`` for
    shapes at full size."""
    return nnx.split(K3Model(cfg, _run(cfg, run), rngs=nnx.Rngs(params=key)))[1].to_pure_dict()


def abstract_params(cfg: K3Config, run: RunConfig | None = None) -> dict:
    """ShapeDtypeStructs of the parameter tree; allocates nothing (works for the full 2.78T model)."""
    return _abstract(cfg, _run(cfg, run), ())[1].to_pure_dict()


def param_axes(cfg: K3Config, *, adapters: bool = False) -> dict:
    """Logical axes (a tuple of ``notation.LOGICAL_AXES`` names) per parameter leaf, from each Param's metadata;
    ``adapters``: with the LoRA adapter leaves of every target too (their axes do not depend on the rank)."""
    run = _run(cfg, None)
    if adapters:
        run = run.replace(lora=LoRAConfig(rank=1, targets=LORA_TARGETS))
    state = _abstract(cfg, run, ())[1]
    axes = nnx.State.from_flat_path({p: tuple(v.get_metadata()["axes"]) for p, v in nnx.to_flat_state(state)})
    return axes.to_pure_dict()


def merge(params, cfg: K3Config, run: RunConfig | None = None) -> K3Model:
    """The module for a state dict (under jit this happens at trace time only). Routed experts may be packed (uint8
    ``w*_packed`` / ``w*_scale`` leaves in place of ``w1``/``w3``/``w2``): they become frozen ``PackedExperts``
    variables, not Params, and run from the bytes."""
    return nnx.merge(graphdef(cfg, run, packed_expert_paths(params)), params)


def hidden_states(params, tokens, cfg: K3Config, run: RunConfig | None = None, *, dispatch=None, segment_ids=None):
    return merge(params, cfg, run).hidden_states(tokens, dispatch=dispatch, segment_ids=segment_ids)


def forward(params, tokens, cfg: K3Config, run: RunConfig | None = None, *, return_aux: bool = False,
            dispatch=None, segment_ids=None, dropout_key=None):
    """tokens [B, T] int → logits [B, T, W] in at-least-fp32 (and the aux dict if ``return_aux``);
    ``segment_ids`` [B, T]: the documents of packed rows, each run on its own (``k3jax.ops.segments``);
    ``dropout_key``: a training step's PRNG key for LoRA dropout (``run.lora.dropout`` > 0; None: no dropout, and at
    rate 0 the key is ignored: the same program as without it)."""
    return merge(params, cfg, run)(tokens, return_aux=return_aux, dispatch=dispatch, segment_ids=segment_ids,
                                   dropout_key=dropout_key)


def lm_loss(params, tokens, targets, cfg: K3Config, run: RunConfig | None = None, *, mask=None, dispatch=None,
            segment_ids=None):
    """Mean next-token cross-entropy (fp32) over ``mask`` (default all positions)."""
    logits = forward(params, tokens, cfg, run, dispatch=dispatch, segment_ids=segment_ids)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if mask is None:
        return jnp.mean(ce)
    mask = mask.astype(ce.dtype)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def mla_dims(cfg: K3Config):
    """(num_heads, nope, rope, value) of the model's MLA layers (``k3jax.layers.mla.MLADims``)."""
    return MLADims(cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)


__all__ = ["abstract_model", "abstract_params", "forward", "graphdef", "hidden_states",
           "init_params", "lm_loss", "merge", "mla_dims", "packed_expert_paths", "param_axes"]
