"""Build the Kimi-Linear golden reference with HF transformers (torch, CPU, float32).

Run with the oracle venv, never with the repo's (this script must not import k3jax; see README.md here):

    /work/oracle-venv/bin/python tests/golden/kimi_linear/make_golden.py

Reads ``hf_config.json`` beside this file (k3jax's ``to_hf_dict`` of the ``kimi-linear-tiny`` preset), random-inits
``KimiLinearForCausalLM`` from it (seeded, float32, eval mode), writes ``ckpt/`` with ``save_pretrained``
(safetensors, in the original Kimi-Linear tensor layout that transformers reverts to on save) and ``golden.npz``:
for three prompts, transformers' cached greedy generation (tokens and per-step logits) and one uncached full
forward over prompt + generated tokens; and, for the longest prompt, the same forward in true float64 (transformers'
modelling source with its internal float32 casts made float64: ``float64_model``), which pins every formula and eps.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types

import numpy as np
import torch
import transformers
from transformers import KimiLinearConfig, KimiLinearForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 0
PROMPT_LENGTHS = (1, 7, 70)  # 70 crosses transformers' 64-token KDA chunk
NEW_TOKENS = 24
# transformers' default std 0.02 makes a 64-wide model nearly the identity on its embedding (flat logits, greedy
# picks that depend on the last token only); 1/sqrt(hidden) keeps every projection's output at unit scale.
INIT_STD = 0.125
NORM_JITTER = 0.2  # RMSNorm weights 1 + N(0, 0.2): a norm weight read from the wrong tensor must show
BIAS_STD = 0.05  # router e_score_correction_bias (transformers inits zeros): changes which experts are picked


def hf_config() -> KimiLinearConfig:
    with open(os.path.join(HERE, "hf_config.json")) as f:
        d = json.load(f)
    assert d.pop("model_type") == "kimi_linear"
    # token ids: transformers' defaults (163584..163839) lie outside the 512-token vocab (nn.Embedding refuses the
    # padding index); no EOS, so every generation runs the full NEW_TOKENS.
    d.update(pad_token_id=None, bos_token_id=None, eos_token_id=None, initializer_range=INIT_STD)
    return KimiLinearConfig(**d)


def build() -> KimiLinearForCausalLM:
    torch.manual_seed(SEED)
    cfg = hf_config()
    model = KimiLinearForCausalLM(cfg).float().eval()
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


def float64_model(ckpt: str):
    """``KimiLinearForCausalLM`` from ``ckpt`` in float64 throughout. transformers computes the KDA core, its gates,
    the norms and the router in float32 even in a float64 model (docs/numerics.md §15.5), so its modelling source is
    re-executed with every ``torch.float32`` / ``.float()`` made float64 (a diagnostic copy; nothing else changes)."""
    import transformers.models.kimi_linear.modeling_kimi_linear as orig

    with open(orig.__file__) as f:
        src = f.read()
    n = src.count("torch.float32") + src.count(".float()")
    src = src.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    name = orig.__name__ + "_float64"
    mod = types.ModuleType(name)
    mod.__package__, mod.__file__ = orig.__package__, orig.__file__
    sys.modules[name] = mod
    exec(compile(src, f"{orig.__file__} [float64]", "exec", dont_inherit=True), mod.__dict__)
    m = mod.KimiLinearForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()
    m.set_attn_implementation("eager")
    m.set_experts_implementation("eager")
    assert {p.dtype for p in m.parameters()} | {b.dtype for b in m.buffers()} == {torch.float64}
    print(f"float64 model: {n} float32 casts rewritten")
    return m


def check_init(model) -> None:
    """Print a KDA layer's A_log / dt_bias (transformers' own FLA-style init, kept), conv and norm weights."""
    sd = model.state_dict()
    for k in sorted(sd):
        if k.startswith("model.layers.1.") and ("A_log" in k or "dt_bias" in k or "conv1d" in k or "norm" in k):
            v = sd[k].float()
            print(f"  {k:55s} {list(v.shape)} mean {v.mean():+.4f} std {v.std():.4f}")


def main() -> int:
    torch.set_num_threads(2)
    model = build()
    for p in model.parameters():
        assert p.dtype == torch.float32
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{sum(p.numel() for p in model.parameters())} parameters")
    check_init(model)

    ckpt = os.path.join(HERE, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    model.save_pretrained(ckpt, safe_serialization=True)
    print("wrote", ckpt, sorted(os.listdir(ckpt)))

    rng = np.random.default_rng(SEED)
    V = model.config.vocab_size
    out: dict[str, np.ndarray] = {}
    worst_gap = worst_rel = 0.0
    for i, n in enumerate(PROMPT_LENGTHS):
        prompt = rng.integers(0, V, n).astype(np.int64)
        ids = torch.from_numpy(prompt)[None]
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, use_cache=True, return_dict_in_generate=True, output_logits=True,
                                 pad_token_id=None, eos_token_id=None)
        seq = gen.sequences[0]
        assert seq.shape[0] == n + NEW_TOKENS and torch.equal(seq[:n], ids[0])
        step = torch.stack([lg[0] for lg in gen.logits]).float().numpy()  # [NEW_TOKENS, V]
        generated = seq[n:].numpy()
        assert (step.argmax(-1) == generated).all(), "greedy tokens are not the argmax of the recorded logits"
        with torch.no_grad():
            fwd = model(seq[None], use_cache=False).logits[0].float().numpy()  # [n + NEW_TOKENS, V]
        ref = fwd[n - 1:n - 1 + NEW_TOKENS]
        gap = np.abs(step - ref).max()
        rel = np.sqrt(np.mean((step - ref) ** 2) / np.mean(ref**2))
        worst_gap, worst_rel = max(worst_gap, float(gap)), max(worst_rel, float(rel))
        top2 = np.sort(step, -1)[:, -2:]
        margin = (top2[:, 1] - top2[:, 0]).min()
        print(f"prompt {i}: length {n}, generated {generated.tolist()}")
        print(f"  cached step logits vs uncached forward: max abs {gap:.3e}, rel-RMS {rel:.3e}; "
              f"logits std {fwd.std():.3f}; distinct generated tokens {len(set(generated.tolist()))}/{NEW_TOKENS}; "
              f"smallest top-1 - top-2 step margin {margin:.3e}")
        out[f"prompt_{i}"] = prompt.astype(np.int32)
        out[f"generated_{i}"] = generated.astype(np.int32)
        out[f"step_logits_{i}"] = step.astype(np.float32)
        out[f"forward_logits_{i}"] = fwd.astype(np.float32)
    # the float64 forward of the longest sequence, from the checkpoint as written (also proves it loads back)
    m64 = float64_model(ckpt)
    i = len(PROMPT_LENGTHS) - 1
    seq = np.concatenate([out[f"prompt_{i}"], out[f"generated_{i}"]]).astype(np.int64)
    with torch.no_grad():
        f64 = m64(torch.from_numpy(seq)[None], use_cache=False).logits[0].numpy()
    assert f64.dtype == np.float64
    d = out[f"forward_logits_{i}"] - f64
    print(f"prompt {i}: float32 forward vs float64 forward: max abs {np.abs(d).max():.3e}, "
          f"rel-RMS {np.sqrt(np.mean(d**2) / np.mean(f64**2)):.3e}")
    out[f"forward_logits_f64_{i}"] = f64
    out["versions"] = np.array([f"torch={torch.__version__}", f"transformers={transformers.__version__}",
                                f"python={sys.version.split()[0]}", f"numpy={np.__version__}"])
    np.savez_compressed(os.path.join(HERE, "golden.npz"), **out)
    print(f"wrote golden.npz; transformers' cached-vs-uncached worst gap: max abs {worst_gap:.3e}, "
          f"rel-RMS {worst_rel:.3e}")
    # fp32 rounding of two different KDA formulations (chunked prefill + recurrent steps vs one chunked pass), on
    # logits of scale ~1: ~1e-5 absolute, ~1e-6 relative. A real cache bug is orders of magnitude larger.
    if worst_rel > 1e-5 or worst_gap > 5e-5:
        print("FAIL: transformers' cached steps disagree with its own full forward beyond fp32 rounding")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
