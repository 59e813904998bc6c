"""Build the PEFT interop golden with HF PEFT over transformers' ``KimiLinearForCausalLM`` (torch, CPU, float32).

Run with the oracle venv, never with the repo's (this script must not import k3jax; see README.md here), after
``make_k3jax_adapter.py`` has written ``adapter_k3jax/``:

    /work/oracle-venv/bin/python tests/golden/kimi_linear/make_peft_golden.py

Both directions of LoRA adapter interop on ``ckpt/``, over the 94-token sequence of golden.npz's prompt 2 (its 70
prompt tokens + 24 generated: crosses transformers' 64-token KDA chunk):

(a) ``adapter_k3jax/`` (k3jax's ``save_adapter``) loaded with ``PeftModel.from_pretrained``: every factor in the file
    must land on a LoRA layer unchanged (PEFT drops keys it has no module for without an error), then its logits;
(b) a PEFT adapter made here: ``get_peft_model`` with ``LoraConfig(r=4, lora_alpha=8, target_modules=<short
    names>)`` on the modules k3jax adapts as "attn", "shared" and "dense" (KDA q/k/v/o, MLA q / kv_a / kv_b / o,
    shared and dense gate/up/down); A by PEFT's own init under ``torch.manual_seed``, B seeded N(0, 0.01) instead of
    PEFT's zeros (so it is no no-op); written with ``save_pretrained`` to ``adapter_peft/``, then its logits.

Writes ``peft_golden.npz``: ``tokens`` int32 [94], ``logits_k3jax_adapter_in_peft`` and ``logits_peft_adapter``
float32 [94, V], ``versions`` (str). Routed experts are not covered: transformers 5 fuses them into 3-D parameters
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), with no per-expert ``nn.Linear`` for k3jax's
per-expert modules to name, and PEFT 0.21's v4 → v5 adapter conversion knows Mixtral / Qwen2-MoE only.
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import peft
import safetensors
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import KimiLinearForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
CKPT = os.path.join(HERE, "ckpt")
K3JAX_ADAPTER = os.path.join(HERE, "adapter_k3jax")
PEFT_ADAPTER = os.path.join(HERE, "adapter_peft")
SEED = 0
PROMPT = 2  # golden.npz's 70-token prompt
RANK, ALPHA, B_STD = 4, 8, 0.01
# k3jax's "attn" (KDA: q/k/v/o; MLA: q, kv_a_proj_with_mqa, kv_b, o), "shared" and "dense" (gate/up/down) targets,
# as a PEFT user writes them: suffixes of module names. None of them matches a KDA gate / beta projection, the
# router or lm_head; the routed experts are no modules at all.
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj",
                  "down_proj"]


def base() -> KimiLinearForCausalLM:
    model = KimiLinearForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    model.name_or_path = "tests/golden/kimi_linear/ckpt"  # the base PEFT records (not this machine's absolute path)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    return model


def logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(tokens.astype(np.int64))[None], use_cache=False).logits[0]
    assert out.dtype == torch.float32
    return out.numpy()


def rel_rms(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref**2)))


def check_loaded(pm, adapter_dir: str) -> int:
    """Every factor of the adapter file is in the PeftModel's adapter state unchanged (and nothing else is)."""
    want = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    got = get_peft_model_state_dict(pm)
    assert set(got) == set(want), (sorted(set(want) - set(got))[:3], sorted(set(got) - set(want))[:3])
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    return len(want)


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":  # PEFT stores target_modules as a set: fix its order in the file
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    with np.load(os.path.join(HERE, "golden.npz")) as z:
        tokens = np.concatenate([z[f"prompt_{PROMPT}"], z[f"generated_{PROMPT}"]]).astype(np.int32)
        golden_base = z[f"forward_logits_{PROMPT}"]

    model = base()
    plain = logits(model, tokens)
    print(f"base from ckpt/ vs golden.npz forward_logits_{PROMPT}: max abs {np.abs(plain - golden_base).max():.3e}")

    # (a) k3jax's adapter in PEFT
    pm = PeftModel.from_pretrained(model, K3JAX_ADAPTER).eval()
    n = check_loaded(pm, K3JAX_ADAPTER)
    k3 = logits(pm, tokens)
    print(f"(a) adapter_k3jax: {n} factors loaded as written; logits vs base rel-RMS {rel_rms(k3, plain):.3e}")

    # (b) PEFT's own adapter
    torch.manual_seed(SEED)
    pm = get_peft_model(base(), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGET_MODULES, lora_dropout=0.0,
                                           bias="none", task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_B." in name:
                p.copy_(B_STD * torch.randn(p.shape, generator=g))
    pm.eval()
    modules = sorted({k.split(".lora_")[0] for k in get_peft_model_state_dict(pm)})
    shutil.rmtree(PEFT_ADAPTER, ignore_errors=True)
    pm.save_pretrained(PEFT_ADAPTER)
    os.remove(os.path.join(PEFT_ADAPTER, "README.md"))  # PEFT's template model card: no content, 5 kB
    own = logits(pm, tokens)
    reloaded = logits(PeftModel.from_pretrained(base(), PEFT_ADAPTER).eval(), tokens)
    assert np.array_equal(own, reloaded), "adapter_peft/ does not reload to the same logits"
    print(f"(b) adapter_peft: {len(modules)} modules, files {sorted(os.listdir(PEFT_ADAPTER))}; logits vs base "
          f"rel-RMS {rel_rms(own, plain):.3e}")

    out = {"tokens": tokens, "logits_k3jax_adapter_in_peft": k3, "logits_peft_adapter": own,
           "versions": np.array([f"torch={torch.__version__}", f"transformers={transformers.__version__}",
                                 f"peft={peft.__version__}", f"safetensors={safetensors.__version__}",
                                 f"python={sys.version.split()[0]}", f"numpy={np.__version__}"])}
    np.savez_compressed(os.path.join(HERE, "peft_golden.npz"), **out)
    print("wrote peft_golden.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
