"""`k3 export`, `k3 inspect`, `k3 logits` end to end on a tiny MXFP4 checkpoint."""

import filecmp
import json
import os
import shutil

import jax
import numpy as np
import pytest

from k3jax.checkpoint.container import MANIFEST_NAME, verify_manifest
from k3jax.checkpoint.load import load
from k3jax.checkpoint.name_map import hf_tensors
from k3jax.checkpoint.save import config_json, save
from k3jax.cli.main import main
from k3jax.config import from_hf, get_preset
from k3jax.model import forward
from k3jax.testing import random_params

CFG = get_preset("k3-tiny")  # MXFP4-capable widths


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("exp") / "src"
    save(random_params(CFG), CFG, d)
    return str(d)


def test_export_from_checkpoint_is_byte_identical_with_manifest(ckpt, tmp_path):
    out = tmp_path / "out"
    assert main(["export", str(out), "--from", ckpt, "--manifest"]) == 0
    for n in os.listdir(ckpt):
        assert filecmp.cmp(os.path.join(ckpt, n), out / n, shallow=False), n
    assert verify_manifest(str(out)) == 6
    with open(out / "model-00003-of-000006.safetensors", "r+b") as f:  # flip one payload byte
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ValueError, match="model-00003-of-000006.safetensors: sha256"):
        load(out, verify=True, progress=False)
    assert main(["export", str(out), "--from", ckpt]) == 2  # exists: refused without --overwrite
    assert MANIFEST_NAME in os.listdir(out)


def test_inspect_reports_and_fails_with_exit_2(ckpt, tmp_path, capsys):
    assert main(["inspect", ckpt, "--json", "--check-data"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] and out["tensors"] == len(hf_tensors(CFG))
    assert out["packed_modules"] == 4 * 8 * 3 and out["scale_bytes"]["0xFF"] == 0
    assert set(out["bytes_by_dtype"]) == {"F32", "BF16", "U8"} and out["payload_bytes"] == out["index_total_size"]
    cfgj = json.loads(config_json(CFG.replace(num_layers=4, full_attn_layers=(4,))))
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "config.json").write_text(json.dumps(cfgj))
    assert main(["inspect", str(bad)]) == 2
    assert "does not match config" in capsys.readouterr().err


def test_config_json_roundtrips_architecture():
    from k3jax.config import architecture

    for cfg in (CFG, get_preset("k3-mini"), get_preset("k3-tiny", expert_format="bf16")):
        assert architecture(from_hf(json.loads(config_json(cfg)))) == architecture(cfg)
    k3 = config_json(get_preset("kimi-k3"))
    assert len(k3) == 7006 and not k3.endswith(b"\n")  # the release's config.json, byte for byte


def test_logits_cli_matches_forward_of_loaded_params(ckpt, tmp_path):
    """Ragged rows (row 1 right-padded with -1): the forward over the rows (padding as id 0) at the real positions,
    NaN at the padding."""
    toks = np.array([[1, 5, 9, 33, 2, 96, 0, 4], [7, 8, 9, -1, -1, -1, -1, -1]], np.int32)
    np.save(tmp_path / "t.npy", toks)
    assert main(["logits", ckpt, "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "o.npy")]) == 0
    got = np.load(tmp_path / "o.npy", allow_pickle=False)
    cfg, params = load(ckpt, progress=False)
    want = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg))(params, np.maximum(toks, 0)))
    real = toks >= 0
    assert got.shape == (2, 8, 97) and np.isfinite(got[real]).all() and np.isnan(got[~real]).all()
    np.testing.assert_array_equal(got[real], want[real])
    np.save(tmp_path / "obj.npy", np.array([object()], dtype=object), allow_pickle=True)
    assert main(["logits", ckpt, "--tokens", str(tmp_path / "obj.npy"), "--out", str(tmp_path / "x.npy")]) == 2
    np.save(tmp_path / "big.npy", np.array([[97]]))
    assert main(["logits", ckpt, "--tokens", str(tmp_path / "big.npy"), "--out", str(tmp_path / "x.npy")]) == 2
