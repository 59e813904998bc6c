"""Write ``adapter_k3jax/`` (or with ``--fused`` ``adapter_k3jax_fused/``): a seeded LoRA adapter for ``ckpt/`` as
k3jax writes it (``save_adapter``, what ``k3 train --lora ... --export`` calls), for the PEFT interop goldens
(``make_peft_golden.py``, ``make_peft_fused_golden.py``; see README.md here).

Run with the repo's venv (this is the k3jax side; the oracle venv never imports k3jax):

    JAX_PLATFORMS=cpu .venv/bin/python tests/golden/kimi_linear/make_k3jax_adapter.py [--fused]

Rank 4, alpha 8 on the targets "attn", "shared", "dense" (every adapted module is an ``nn.Linear`` in transformers'
``KimiLinearForCausalLM``; its routed experts are fused 3-D parameters, so "experts" has no PEFT module to map to).
The factors are drawn with NumPy (no jax PRNG, so a rerun is byte-identical whatever the jax version): A ~ U(±1/8)
(PEFT's and k3jax's kaiming bound 1/sqrt(fan_in) for the 64-wide hidden input), B ~ N(0, 0.01) instead of the
zeros of a fresh adapter, so it moves the logits: 59% rel-RMS over golden.npz's 94-token prompt-2 sequence (printed;
this random model's top-2-of-8 routing is fragile: 9-48 of the 94 tokens change expert pair per MoE layer).

``--fused``: rank 4, alpha 8 on "attn" and "experts", ``peft_experts="fused"`` (``k3 train --lora ...
--adapter-experts fused``), NumPy seed 1: the attention projections are ``nn.Linear`` modules (``target_modules``),
the routed experts PEFT ``target_parameters`` over ``mlp.experts.gate_up_proj`` (rank 8, w1 and w3 block-diagonal,
``rank_pattern`` / ``alpha_pattern``) and ``mlp.experts.down_proj`` (rank 4).
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CKPT = os.path.join(HERE, "ckpt")
RANK, ALPHA = 4, 8.0
# the two adapters: (directory, NumPy seed, targets, routed experts' PEFT layout)
VARIANTS = {False: ("adapter_k3jax", 0, ("attn", "shared", "dense"), "auto"),
            True: ("adapter_k3jax_fused", 1, ("attn", "experts"), "fused")}
A_BOUND, B_STD = 0.125, 0.01


def leaves(cfg, run, seed: int) -> dict:
    """The adapter leaves of ``run.lora`` (state layout, ``abstract_params``' shapes and dtypes), seeded."""
    from k3jax.layers.lora import is_adapter
    from k3jax.model import abstract_params
    from k3jax.pytree import key_names

    rng = np.random.default_rng(seed)
    tree: dict = {}
    for path, s in jax.tree_util.tree_flatten_with_path(abstract_params(cfg, run))[0]:
        names = key_names(path)
        if is_adapter(names[-1]):
            node = tree
            for k in names[:-1]:
                node = node.setdefault(k, {})
            x = rng.uniform(-A_BOUND, A_BOUND, s.shape) if names[-1].endswith("_lora_a") else \
                B_STD * rng.standard_normal(s.shape)
            node[names[-1]] = x.astype(s.dtype)
    return tree


def write(out_dir: str | None = None, fused: bool = False) -> dict:
    from k3jax.checkpoint.peft import save_adapter
    from k3jax.checkpoint.source import model_config
    from k3jax.config import LoRAConfig, default_run

    name, seed, targets, layout = VARIANTS[fused]
    cfg = model_config(ckpt=CKPT, preset=None)
    run = default_run(cfg).replace(lora=LoRAConfig(rank=RANK, alpha=ALPHA, targets=targets, peft_experts=layout))
    return save_adapter(leaves(cfg, run, seed), cfg, run, out_dir or os.path.join(HERE, name),
                        base="tests/golden/kimi_linear/ckpt", overwrite=True)


def main() -> int:
    from k3jax.checkpoint.source import load_model
    from k3jax.model import forward

    fused = "--fused" in sys.argv[1:]
    print(write(fused=fused))
    with np.load(os.path.join(HERE, "golden.npz")) as z:
        tokens = np.concatenate([z["prompt_2"], z["generated_2"]])[None].astype(np.int32)
    out = {}
    for name, adapter in (("base", None), ("adapter", os.path.join(HERE, VARIANTS[fused][0]))):
        cfg, run, params = load_model(ckpt=CKPT, preset=None, adapter=adapter)
        out[name] = np.asarray(jax.jit(lambda p, t, cfg=cfg, run=run: forward(p, t, cfg, run))(params, tokens))
    d = out["adapter"] - out["base"]
    rel = np.sqrt(np.mean(d**2) / np.mean(out["base"] ** 2))
    print(f"k3jax logits with the adapter vs without (94 tokens): rel-RMS {rel:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
