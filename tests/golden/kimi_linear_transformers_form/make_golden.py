"""A Kimi-Linear checkpoint in transformers' own config form, and its logits (HF transformers, torch CPU, float32).

Run with the oracle venv, never with the repo's (this script must not import k3jax; see README.md here):

    /work/oracle-venv/bin/python tests/golden/kimi_linear_transformers_form/make_golden.py

Builds ``KimiLinearConfig`` the way a transformers user does, from the class's own arguments (``layer_types``,
``mlp_layer_types``, ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``, ``num_local_experts``,
...; no ``linear_attn_config``, no ``first_k_dense_replace``), random-inits ``KimiLinearForCausalLM`` from it
(seeded, float32, eval mode), writes ``ckpt/`` with ``save_pretrained`` (safetensors; its ``config.json`` is
transformers' form, its tensor names the release's, which transformers reverts to on save) and ``golden.npz``: the
logits of one uncached forward over fixed token ids, from the model as built and again from ``ckpt/`` loaded back
(the two must be equal).

The schedule differs from transformers' default (MLA at 0-based i % 4 == 0) and from a leading single dense layer,
so a reader that ignored ``layer_types`` / ``mlp_layer_types`` would build another model: MLA at 1-based layers 2
and 5, dense MLPs at layers 1 and 2, and a short-conv kernel of 3 (not the default 4).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import KimiLinearConfig, KimiLinearForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 0
HIDDEN = 32
BATCH, LENGTH = 2, 70  # 70 crosses transformers' 64-token KDA chunk
INIT_STD = HIDDEN ** -0.5  # unit-scale projections (transformers' 0.02 makes a 32-wide model nearly the identity)
NORM_JITTER = 0.2  # RMSNorm weights 1 + N(0, 0.2): a norm weight read from the wrong tensor must show
BIAS_STD = 0.05  # router e_score_correction_bias (transformers inits zeros): changes which experts are picked


def hf_config() -> KimiLinearConfig:
    """transformers' own arguments only (its class's field names; ``save_pretrained`` writes some under the
    release's names through ``attribute_map``: ``num_experts``, ``num_experts_per_token``, ...)."""
    return KimiLinearConfig(
        vocab_size=256, hidden_size=HIDDEN, num_hidden_layers=5,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=3,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16,
        intermediate_size=64, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, routed_scaling_factor=2.446, norm_topk_prob=True, n_group=1, topk_group=1,
        hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=INIT_STD,
        # transformers' defaults (163584..163839) lie outside a 256-token vocab (nn.Embedding refuses the padding id)
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def build() -> KimiLinearForCausalLM:
    torch.manual_seed(SEED)
    model = KimiLinearForCausalLM(hf_config()).float().eval()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + NORM_JITTER * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(BIAS_STD * torch.randn(b.shape, generator=g))
    return model


def logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64)), use_cache=False).logits.float().numpy()


def main() -> int:
    torch.set_num_threads(2)
    model = build()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{sum(p.numel() for p in model.parameters())} parameters")
    ckpt = os.path.join(HERE, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    model.save_pretrained(ckpt, safe_serialization=True)
    with open(os.path.join(ckpt, "config.json")) as f:
        written = json.load(f)
    assert "linear_attn_config" not in written and "first_k_dense_replace" not in written, sorted(written)
    print("wrote", ckpt, sorted(os.listdir(ckpt)))
    print("config.json keys:", ", ".join(sorted(written)))

    tokens = np.random.default_rng(SEED).integers(0, model.config.vocab_size, (BATCH, LENGTH)).astype(np.int32)
    out = logits(model, tokens)
    back = KimiLinearForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    back.set_attn_implementation("eager")
    back.set_experts_implementation("eager")
    again = logits(back, tokens)
    print(f"logits std {out.std():.3f}, |max| {np.abs(out).max():.3f}; reloaded vs built: max abs "
          f"{np.abs(again - out).max():.3e}")
    if not np.array_equal(again, out):
        print("FAIL: the checkpoint does not load back into transformers as the same model")
        return 1
    np.savez_compressed(
        os.path.join(HERE, "golden.npz"), tokens=tokens, logits=out.astype(np.float32),
        versions=np.array([f"torch={torch.__version__}", f"transformers={transformers.__version__}",
                           f"python={sys.version.split()[0]}", f"numpy={np.__version__}"]))
    print("wrote golden.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
