"""Write ``adapter_k3jax/``: a seeded LoRA adapter for ``ckpt/`` as k3jax writes it (``save_adapter``, what
``k3 train --lora ... --export`` calls), for the PEFT interop golden (``make_peft_golden.py``; see README.md here).

Run with the repo's venv (this is the k3jax side; the oracle venv never imports k3jax):

    JAX_PLATFORMS=cpu .venv/bin/python tests/golden/kimi_linear/make_k3jax_adapter.py

Rank 4, alpha 8 on the targets "attn", "shared", "dense" (every adapted module is an ``nn.Linear`` in transformers'
``KimiLinearForCausalLM``; its routed experts are fused 3-D parameters, so "experts" has no PEFT module to map to).
The factors are drawn with NumPy (no jax PRNG, so a rerun is byte-identical whatever the jax version): A ~ U(±1/8)
(PEFT's and k3jax's kaiming bound 1/sqrt(fan_in) for the 64-wide hidden input), B ~ N(0, 0.01) instead of the
zeros of a fresh adapter, so it moves the logits: 59% rel-RMS over golden.npz's 94-token prompt-2 sequence (printed;
this random model's top-2-of-8 routing is fragile: 9-48 of the 94 tokens change expert pair per MoE layer).
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CKPT = os.path.join(HERE, "ckpt")
OUT = os.path.join(HERE, "adapter_k3jax")
SEED = 0
RANK, ALPHA = 4, 8.0
TARGETS = ("attn", "shared", "dense")
A_BOUND, B_STD = 0.125, 0.01


def leaves(cfg, run) -> dict:
    """The adapter leaves of ``run.lora`` (state layout, ``abstract_params``' shapes and dtypes), seeded."""
    from k3jax.layers.lora import is_adapter
    from k3jax.model import abstract_params
    from k3jax.pytree import key_names

    rng = np.random.default_rng(SEED)
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


def write(out_dir: str = OUT) -> dict:
    from k3jax.checkpoint.peft import save_adapter
    from k3jax.checkpoint.source import model_config
    from k3jax.config import LoRAConfig, default_run

    cfg = model_config(ckpt=CKPT, preset=None)
    run = default_run(cfg).replace(lora=LoRAConfig(rank=RANK, alpha=ALPHA, targets=TARGETS))
    return save_adapter(leaves(cfg, run), cfg, run, out_dir, base="tests/golden/kimi_linear/ckpt", overwrite=True)


def main() -> int:
    from k3jax.checkpoint.source import load_model
    from k3jax.model import forward

    print(write())
    with np.load(os.path.join(HERE, "golden.npz")) as z:
        tokens = np.concatenate([z["prompt_2"], z["generated_2"]])[None].astype(np.int32)
    out = {}
    for name, adapter in (("base", None), ("adapter", OUT)):
        cfg, run, params = load_model(ckpt=CKPT, preset=None, adapter=adapter)
        out[name] = np.asarray(jax.jit(lambda p, t, cfg=cfg, run=run: forward(p, t, cfg, run))(params, tokens))
    d = out["adapter"] - out["base"]
    rel = np.sqrt(np.mean(d**2) / np.mean(out["base"] ** 2))
    print(f"k3jax logits with the adapter vs without (94 tokens): rel-RMS {rel:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
