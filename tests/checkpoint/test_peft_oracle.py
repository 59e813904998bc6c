"""LoRA adapters between k3jax and HF PEFT 0.21 over transformers 5.23's ``KimiLinearForCausalLM``, both ways, on the
committed kimi-linear-tiny checkpoint (tests/golden/kimi_linear: README.md there).

Torch and PEFT never enter this environment: ``make_peft_golden.py`` ran them once in the oracle venv and committed
``peft_golden.npz`` (the 94-token sequence of golden.npz's prompt 2, which crosses the 64-token KDA chunk):

- ``logits_k3jax_adapter_in_peft``: ``adapter_k3jax/`` (written by k3jax's ``save_adapter``:
  ``make_k3jax_adapter.py``) loaded with ``PeftModel.from_pretrained``, every factor landing on a LoRA layer;
- ``logits_peft_adapter``: ``adapter_peft/``, made with ``get_peft_model`` + seeded B and ``save_pretrained``.

Here k3jax loads each adapter as ``k3 logits --ckpt tests/golden/kimi_linear/ckpt --adapter DIR`` does
(``load_model``: ``load_adapter`` + the preset's run settings) and its float32 logits equal PEFT's within rel-RMS
1e-4; both adapters move the logits (≥ 1e-2 rel-RMS from golden.npz's base forward), and ``save_adapter`` still
writes ``adapter_k3jax/`` byte for byte (so a change to the module names k3jax writes meets PEFT here).

Covered: k3jax's "attn", "shared" and "dense" targets (56 ``nn.Linear`` modules), and "experts" in transformers 5's
fused layout (PEFT ``target_parameters`` over ``mlp.experts.gate_up_proj`` / ``down_proj``: ``peft_fused_golden.npz``
from ``make_peft_fused_golden.py``, the k3jax side ``make_k3jax_adapter.py --fused``).
"""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from k3jax.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, SIDECAR
from k3jax.checkpoint.source import load_model
from k3jax.config import LoRAConfig
from k3jax.model import forward
from k3jax.testing import assert_close, rel_rms

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "kimi_linear")
CKPT = os.path.join(GOLDEN, "ckpt")
REL_RMS = 1e-4
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("attn", "shared", "dense"))
MODULES = 56  # 8 layers: 6 KDA x 4 + 2 MLA x 4 attention projections, 7 shared + 1 dense MLP x 3


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(GOLDEN, "peft_golden.npz"), allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    with np.load(os.path.join(GOLDEN, "golden.npz"), allow_pickle=False) as z:
        out["base"] = z["forward_logits_2"]
        assert np.array_equal(out["tokens"], np.concatenate([z["prompt_2"], z["generated_2"]]))
    return out


@pytest.fixture(scope="module")
def logits_with():
    """k3jax's float32 logits with an adapter directory, as ``k3 logits --adapter`` computes them (one compile)."""
    fns = {}

    def run(adapter, tokens, lora=LORA):
        cfg, run_cfg, params = load_model(ckpt=CKPT, preset=None, adapter=os.path.join(GOLDEN, adapter))
        assert run_cfg.lora == lora
        if run_cfg not in fns:
            fns[run_cfg] = jax.jit(lambda p, t: forward(p, t, cfg, run_cfg))
        return np.asarray(fns[run_cfg](params, tokens[None].astype(np.int32)))[0]

    return run


@pytest.mark.parametrize("adapter, key", [("adapter_k3jax", "logits_k3jax_adapter_in_peft"),
                                          ("adapter_peft", "logits_peft_adapter")],
                         ids=["k3jax-adapter-in-peft", "peft-adapter-in-k3jax"])
def test_adapter_logits_match_peft(golden, logits_with, adapter, key):
    got, want = logits_with(adapter, golden["tokens"]), golden[key]
    assert got.dtype == np.float32 and want.dtype == np.float32
    err = assert_close(got, want, REL_RMS, name=f"{adapter} logits vs PEFT")
    print(f"{adapter}: rel-RMS {err:.2e}, max abs {np.abs(got - want).max():.2e}")
    assert rel_rms(want, golden["base"]) >= 1e-2, "the adapter hardly moves PEFT's logits"
    assert rel_rms(got, golden["base"]) >= 1e-2


def test_adapter_directories(golden):
    """The PEFT directory names transformers' modules (``mlp.shared_experts``) with short target_modules and no
    sidecar; the k3jax one lists the same 56 modules by full name."""
    mods = {}
    for adapter in ("adapter_k3jax", "adapter_peft"):
        d = os.path.join(GOLDEN, adapter)
        keys = load_file(os.path.join(d, ADAPTER_WEIGHTS)).keys()
        mods[adapter] = {k.split(".lora_")[0] for k in keys}
        assert len(keys) == 2 * MODULES == 2 * len(mods[adapter])
        conf = json.load(open(os.path.join(d, ADAPTER_CONFIG)))
        assert (conf["r"], conf["lora_alpha"], conf["peft_type"]) == (4, 8, "LORA")
    assert mods["adapter_k3jax"] == mods["adapter_peft"]
    assert "base_model.model.model.layers.1.mlp.shared_experts.gate_proj" in mods["adapter_peft"]
    assert not os.path.exists(os.path.join(GOLDEN, "adapter_peft", SIDECAR))
    assert os.path.exists(os.path.join(GOLDEN, "adapter_k3jax", SIDECAR))


def test_save_adapter_still_writes_the_committed_adapter(tmp_path):
    """``make_k3jax_adapter.write`` now reproduces ``adapter_k3jax/`` byte for byte: what PEFT was shown is what
    k3jax writes."""
    spec = importlib.util.spec_from_file_location("make_k3jax_adapter", os.path.join(GOLDEN, "make_k3jax_adapter.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write(str(tmp_path / "a"))
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, SIDECAR):
        with open(tmp_path / "a" / name, "rb") as f, open(os.path.join(GOLDEN, "adapter_k3jax", name), "rb") as g:
            assert f.read() == g.read(), name


# ---- routed experts in transformers 5's fused layout (PEFT target_parameters; make_peft_fused_golden.py)

FUSED_LORA = LoRAConfig(rank=4, alpha=8.0, targets=("attn", "experts"))


@pytest.fixture(scope="module")
def fused_golden():
    with np.load(os.path.join(GOLDEN, "peft_fused_golden.npz"), allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    with np.load(os.path.join(GOLDEN, "golden.npz"), allow_pickle=False) as z:
        out["base"] = z["forward_logits_2"]
        assert np.array_equal(out["tokens"], np.concatenate([z["prompt_2"], z["generated_2"]]))
    return out


@pytest.mark.parametrize("adapter, key", [("adapter_k3jax_fused", "logits_k3jax_fused_adapter_in_peft"),
                                          ("adapter_peft_fused", "logits_peft_fused_adapter")],
                         ids=["k3jax-fused-adapter-in-peft", "peft-fused-adapter-in-k3jax"])
def test_fused_expert_adapter_logits_match_peft(fused_golden, logits_with, adapter, key):
    """`k3 logits --adapter` over a target_parameters adapter (routed experts as fused 3-D parameters): PEFT's own
    plain rank-4 gate_up_proj (one A for gate and up) and k3jax's rank-8 block-diagonal one."""
    got = logits_with(adapter, fused_golden["tokens"], FUSED_LORA)
    want = fused_golden[key]
    assert got.dtype == np.float32 and want.dtype == np.float32
    err = assert_close(got, want, REL_RMS, name=f"{adapter} logits vs PEFT")
    print(f"{adapter}: rel-RMS {err:.2e}, max abs {np.abs(got - want).max():.2e}, max rel "
          f"{np.abs(got - want).max() / np.abs(want).max():.2e}")
    assert rel_rms(want, fused_golden["base"]) >= 1e-2, "the adapter hardly moves PEFT's logits"
    assert rel_rms(got, fused_golden["base"]) >= 1e-2


def test_fused_adapter_directories():
    """Both fused directories: the same tensor names (PEFT nests gate_up_proj's wrapper inside down_proj's:
    ``experts.base_layer.lora_*`` / ``experts.lora_*``) and target_parameters; k3jax's gate_up_proj is rank 8."""
    keys, confs = {}, {}
    for adapter in ("adapter_k3jax_fused", "adapter_peft_fused"):
        d = os.path.join(GOLDEN, adapter)
        t = load_file(os.path.join(d, ADAPTER_WEIGHTS))
        keys[adapter] = {k: v.shape for k, v in t.items()}
        confs[adapter] = json.load(open(os.path.join(d, ADAPTER_CONFIG)))
        assert confs[adapter]["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert keys["adapter_k3jax_fused"].keys() == keys["adapter_peft_fused"].keys()
    e = "base_model.model.model.layers.3.mlp.experts."
    assert keys["adapter_peft_fused"][e + "base_layer.lora_A.weight"] == (4 * 8, 64)     # gate_up: [r E, H]
    assert keys["adapter_peft_fused"][e + "base_layer.lora_B.weight"] == (64, 4 * 8)     # [2I, r E]
    assert keys["adapter_k3jax_fused"][e + "base_layer.lora_A.weight"] == (8 * 8, 64)    # rank 2r
    assert keys["adapter_k3jax_fused"][e + "lora_B.weight"] == keys["adapter_peft_fused"][e + "lora_B.weight"] \
        == (64, 4 * 8)                                                                    # down: [H, r E]
    assert confs["adapter_k3jax_fused"]["rank_pattern"] == {"mlp.experts.gate_up_proj": 8}
    assert confs["adapter_k3jax_fused"]["alpha_pattern"] == {"mlp.experts.gate_up_proj": 16}


def test_save_adapter_still_writes_the_committed_fused_adapter(tmp_path):
    spec = importlib.util.spec_from_file_location("make_k3jax_adapter", os.path.join(GOLDEN, "make_k3jax_adapter.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write(str(tmp_path / "a"), fused=True)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, SIDECAR):
        with open(tmp_path / "a" / name, "rb") as f, open(os.path.join(GOLDEN, "adapter_k3jax_fused", name), "rb") as g:
            assert f.read() == g.read(), name
