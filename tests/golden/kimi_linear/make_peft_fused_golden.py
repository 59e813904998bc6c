"""Build the fused-expert PEFT golden: HF PEFT ``target_parameters`` LoRA over transformers' fused routed experts
(``KimiLinearForCausalLM``, torch, CPU, float32), both ways.

Run with the oracle venv, never with the repo's (this script must not import k3jax; see README.md here), after
``make_k3jax_adapter.py --fused`` has written ``adapter_k3jax_fused/``:

    /work/oracle-venv/bin/python tests/golden/kimi_linear/make_peft_fused_golden.py

transformers 5 holds each MoE layer's routed experts as ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows, then
up) and ``mlp.experts.down_proj`` [E, H, I]; PEFT reaches them only through ``LoraConfig(target_parameters=...)``
(``lora.ParamWrapper``). Over the 94-token sequence of golden.npz's prompt 2:

(a) a PEFT adapter made here: ``get_peft_model`` with ``LoraConfig(r=4, lora_alpha=8, target_modules=<the attention
    projections k3jax adapts as "attn">, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``
    (a plain rank-4 gate_up_proj: one A for gate and up), A by PEFT's own init under ``torch.manual_seed``, every
    lora_B then seeded N(0, 0.01); ``save_pretrained`` to ``adapter_peft_fused/``, reloaded (same logits), logits;
(b) ``adapter_k3jax_fused/`` (k3jax's ``save_adapter``, ``peft_experts="fused"``: gate_up_proj rank 8 with w1 / w3
    block-diagonal through ``rank_pattern`` / ``alpha_pattern``) loaded with ``PeftModel.from_pretrained``: every
    factor in the file must land in the PeftModel's adapter state unchanged, and each ParamWrapper's rank and scaling
    be the file's; then its logits.

Writes ``peft_fused_golden.npz``: ``tokens`` int32 [94], ``logits_peft_fused_adapter`` and
``logits_k3jax_fused_adapter_in_peft`` float32 [94, V], ``versions`` (str).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import peft
import safetensors
import torch
import transformers
from make_peft_golden import base, logits, rel_rms  # the per-module script beside this one: same base, same forward
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import ParamWrapper
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
K3JAX_ADAPTER = os.path.join(HERE, "adapter_k3jax_fused")
PEFT_ADAPTER = os.path.join(HERE, "adapter_peft_fused")
SEED = 0
PROMPT = 2  # golden.npz's 70-token prompt
RANK, ALPHA, B_STD = 4, 8, 0.01
# k3jax's "attn" target (KDA q/k/v/o; MLA q, kv_a_proj_with_mqa, kv_b, o) as module-name suffixes
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def check_loaded(pm, adapter_dir: str) -> int:
    """Every factor of the adapter file is in the PeftModel's adapter state unchanged (and nothing else is), and every
    ParamWrapper has the rank and scaling adapter_config.json gives it (its rank / alpha patterns included)."""
    want = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    got = get_peft_model_state_dict(pm)
    assert set(got) == set(want), (sorted(set(want) - set(got))[:3], sorted(set(got) - set(want))[:3])
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    conf = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    wrappers = [m for m in pm.modules() if isinstance(m, ParamWrapper)]
    assert len(wrappers) == 2 * 7, len(wrappers)  # 7 MoE layers x (gate_up_proj, down_proj)
    for m in wrappers:
        key = next((k for k in conf["rank_pattern"] if k.endswith(m.parameter_name)), None)
        r, a = (conf["rank_pattern"][key], conf["alpha_pattern"][key]) if key else (conf["r"], conf["lora_alpha"])
        assert (m.r["default"], m.scaling["default"], m.num_experts) == (r, a / r, 8), (m.parameter_name, m.r)
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

    # (a) PEFT's own fused adapter
    torch.manual_seed(SEED)
    pm = get_peft_model(base(), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGET_MODULES,
                                           target_parameters=TARGET_PARAMETERS, lora_dropout=0.0, bias="none",
                                           task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_B." in name:
                p.copy_(B_STD * torch.randn(p.shape, generator=g))
    pm.eval()
    shutil.rmtree(PEFT_ADAPTER, ignore_errors=True)
    pm.save_pretrained(PEFT_ADAPTER)
    os.remove(os.path.join(PEFT_ADAPTER, "README.md"))  # PEFT's template model card: no content
    own = logits(pm, tokens)
    reloaded = PeftModel.from_pretrained(base(), PEFT_ADAPTER).eval()
    n = check_loaded(reloaded, PEFT_ADAPTER)
    assert np.array_equal(own, logits(reloaded, tokens)), "adapter_peft_fused/ does not reload to the same logits"
    print(f"(a) adapter_peft_fused: {n} factors, files {sorted(os.listdir(PEFT_ADAPTER))}; logits vs base rel-RMS "
          f"{rel_rms(own, plain):.3e}")

    # (b) k3jax's fused adapter in PEFT
    pm = PeftModel.from_pretrained(base(), K3JAX_ADAPTER).eval()
    n = check_loaded(pm, K3JAX_ADAPTER)
    k3 = logits(pm, tokens)
    print(f"(b) adapter_k3jax_fused: {n} factors loaded as written; logits vs base rel-RMS {rel_rms(k3, plain):.3e}")

    out = {"tokens": tokens, "logits_peft_fused_adapter": own, "logits_k3jax_fused_adapter_in_peft": k3,
           "versions": np.array([f"torch={torch.__version__}", f"transformers={transformers.__version__}",
                                 f"peft={peft.__version__}", f"safetensors={safetensors.__version__}",
                                 f"python={sys.version.split()[0]}", f"numpy={np.__version__}"])}
    np.savez_compressed(os.path.join(HERE, "peft_fused_golden.npz"), **out)
    print("wrote peft_fused_golden.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
