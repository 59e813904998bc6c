"""`--adapter DIR` (a PEFT-layout LoRA adapter, k3jax/checkpoint/peft.py) in `k3 logits`, `k3 generate` and
`k3 route` (k3jax/checkpoint/source.py ``load_model``): a fresh adapter (B = 0) leaves the logits bit for bit; a
trained one gives the forward of the merged tree under ``run.replace(lora=...)``, which is the base model with
W + scale A B; a bad adapter exits 2 naming its file, with nothing written."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from k3jax.checkpoint.load import load
from k3jax.checkpoint.peft import SIDECAR, save_adapter
from k3jax.checkpoint.save import save
from k3jax.cli.main import main
from k3jax.config import LORA_TARGETS, LoRAConfig, default_run, get_preset
from k3jax.layers.experts import merge_trees
from k3jax.layers.lora import is_adapter
from k3jax.model import abstract_params, forward
from k3jax.ops.lora import lora_weight
from k3jax.pytree import key_names
from k3jax.testing import random_params

CFG = get_preset("k3-tiny")
LORA = LoRAConfig(rank=4, alpha=8.0, targets=LORA_TARGETS)
RUN = default_run(CFG).replace(lora=LORA)
TOKENS = np.array([[1, 5, 9, 33, 2, 96, 0, 4], [7, 8, 9, 10, 11, -1, -1, -1]], np.int32)


def _adapter(fresh: bool) -> dict:
    """Adapter leaves on every target group: A random, B zero (fresh) or random (trained)."""
    rng = np.random.default_rng(1)
    tree: dict = {}
    for path, s in jax.tree_util.tree_flatten_with_path(abstract_params(CFG, RUN))[0]:
        names = key_names(path)
        if is_adapter(names[-1]):
            node = tree
            for k in names[:-1]:
                node = node.setdefault(k, {})
            zero = fresh and names[-1].endswith("_lora_b")
            node[names[-1]] = np.zeros(s.shape, s.dtype) if zero else (0.5 * rng.standard_normal(s.shape)).astype(
                s.dtype)
    return tree


def _merged_weights(params: dict) -> dict:
    """The base tree with each adapted W replaced by W + scale A B and the factors dropped."""
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out[k] = _merged_weights(v)
        elif not is_adapter(k):
            a, b = params.get(f"{k}_lora_a"), params.get(f"{k}_lora_b")
            out[k] = v if a is None else lora_weight(v, a, b, LORA.scale)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapter")
    save(random_params(CFG), CFG, d / "ckpt")
    np.save(d / "t.npy", TOKENS)
    for name in ("fresh", "trained"):
        save_adapter(_adapter(name == "fresh"), CFG, RUN, d / name)
    return d


def _logits(d, out, *extra):
    assert main(["logits", "--ckpt", str(d / "ckpt"), "--tokens", str(d / "t.npy"), "--out", str(out), *extra]) == 0
    return np.load(out)


def test_logits_with_an_adapter(setup, tmp_path):
    d, real = setup, TOKENS >= 0
    _, base = load(d / "ckpt", progress=False)
    toks = np.maximum(TOKENS, 0)
    plain = jax.jit(lambda p, t: forward(p, t, CFG))
    want_base = np.asarray(plain(base, toks))
    fresh = _logits(d, tmp_path / "fresh.npy", "--adapter", str(d / "fresh"))
    np.testing.assert_array_equal(fresh[real], want_base[real])                 # B = 0: bit for bit the base
    assert np.isnan(fresh[~real]).all()
    trained = _logits(d, tmp_path / "trained.npy", "--adapter", str(d / "trained"))
    tree = merge_trees(base, _adapter(False))
    want = np.asarray(jax.jit(lambda p, t: forward(p, t, CFG, RUN))(tree, toks))
    np.testing.assert_array_equal(trained[real], want[real])
    # independent of the LoRA code path: the plain model on W + scale A B (orientation through the whole model)
    merged = np.asarray(plain(_merged_weights(tree), toks))
    np.testing.assert_allclose(trained[real], merged[real], rtol=0, atol=2e-4 * np.abs(merged).max())
    assert np.abs(trained[real] - want_base[real]).max() > 0.1 * np.abs(want_base[real]).max()  # it did something


@pytest.mark.parametrize("command", ["logits", "generate", "route"])
def test_bad_adapter_exits_2_naming_the_file_and_writes_nothing(setup, tmp_path, capsys, command):
    bad = tmp_path / "bad"
    shutil.copytree(setup / "trained", bad)
    side = json.loads((bad / SIDECAR).read_text())
    side["architecture"]["hidden_size"] = 128
    (bad / SIDECAR).write_text(json.dumps(side))
    out = tmp_path / "out.npy"
    ckpt, toks = str(setup / "ckpt"), str(setup / "t.npy")
    argv = {"logits": ["logits", "--ckpt", ckpt, "--tokens", toks, "--out", str(out)],
            "generate": ["generate", "--ckpt", ckpt, "--tokens", toks, "--out", str(out), "--max-new-tokens", "2"],
            "route": ["route", "--ckpt", ckpt, "--tokens", toks, "--plots", str(tmp_path / "plots"), "--json"]}
    assert main([*argv[command], "--adapter", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"k3 {command}: error: {bad / SIDECAR}: the adapter was made for another base" in err, err
    assert "hidden_size" in err and sorted(os.listdir(tmp_path)) == ["bad"]
    if command == "route":
        assert main(["route", "--ckpt", ckpt, "--static", "--adapter", str(setup / "trained")]) == 2
        assert "--adapter does not apply to --static" in capsys.readouterr().err
