"""The QAT rounding rule travels with the trained model (docs/numerics.md §10.7): a model trained with a non-default
``qat_weight_rule`` exports onto its own grid — its exported MXFP4 experts dequantize to exactly the fake-quant
values it trained with — through ``export_trained``, a re-export with ``k3 export --from``, and an export from the
train checkpoint, which records the rule beside the run settings (one written before the record reads as "even")."""

import filecmp
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.checkpoint import load
from k3jax.checkpoint.save import export_trained
from k3jax.cli.main import main
from k3jax.config import PRESET_RUNS, default_run, get_preset
from k3jax.model import init_params
from k3jax.ops.mx import fake_quant_mxfp4
from k3jax.pytree import key_names
from k3jax.train.ckpt import manager, read_meta, trained_settings
from k3jax.train.loop import train
from k3jax.train.settings import TrainConfig

TINY = get_preset("k3-tiny")
RULE = "floor"  # not the default "even": on random weights the two grids differ in many blocks


def _experts(params) -> dict:
    """{path: float expert stack [..., E, in, out]} of every routed expert stack."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {key_names(p): np.asarray(x) for p, x in flat
            if len(p) >= 2 and key_names(p)[-2] == "experts" and key_names(p)[-1] in ("w1", "w2", "w3")}


def _grid(w, rule: str) -> np.ndarray:
    """The QAT forward's weights: MXFP4 fake-quant in blocks along ``in``."""
    return np.asarray(fake_quant_mxfp4(jnp.asarray(w), axis=-2, rule=rule))


def _assert_on_grid(exported: str, trained: dict, rule: str) -> None:
    want = {p: _grid(w, rule) for p, w in _experts(trained).items()}
    got = _experts(load(exported)[1])
    assert want and got.keys() == want.keys()
    for p in want:
        np.testing.assert_array_equal(got[p], want[p], err_msg="/".join(map(str, p)))
    assert any(not np.array_equal(want[p], _grid(w, "even")) for p, w in _experts(trained).items())


def test_export_packs_onto_the_rule_the_model_trained_with_and_export_from_keeps_it(tmp_path):
    params = init_params(TINY, jax.random.key(0))
    r = export_trained(params, TINY, default_run(TINY, qat="weights", qat_weight_rule=RULE), str(tmp_path / "a"))
    assert r["expert_format"] == "mxfp4"
    _assert_on_grid(str(tmp_path / "a"), params, RULE)
    assert main(["export", str(tmp_path / "b"), "--from", str(tmp_path / "a")]) == 0  # packed experts: a byte copy
    files = sorted(os.listdir(tmp_path / "a"))
    assert files == sorted(os.listdir(tmp_path / "b"))
    assert all(filecmp.cmp(tmp_path / "a" / f, tmp_path / "b" / f, shallow=False) for f in files)


def test_a_checkpoint_without_the_record_trained_with_the_defaults():
    run = default_run(TINY, qat="weights", qat_weight_rule="ceil", qat_act_rule="floor")
    old = trained_settings({"train": {}}, run)
    assert (old.qat_weight_rule, old.qat_act_rule) == ("even", "ceil")
    assert trained_settings({"run": {"qat_weight_rule": RULE, "qat_act_rule": "even"}}, run).qat_weight_rule == RULE


@pytest.mark.slow  # two builds of the k3-tiny QAT step
def test_the_rule_is_stored_in_the_train_checkpoint_and_its_export_uses_it(tmp_path, monkeypatch):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    tc = TrainConfig(preset="k3-tiny", qat="weights", steps=2, batch=4, seq_len=16, max_bytes=100_000,
                     eval_every=1000, eval_windows=4, devices=1, progress=False, peak_flops=1e9, ckpt_dir=ck,
                     async_ckpt=False)
    with monkeypatch.context() as m:  # a run whose model trains on the floor grid (the rule is a run setting)
        m.setitem(PRESET_RUNS, "k3-tiny", PRESET_RUNS["k3-tiny"].replace(qat_weight_rule=RULE))
        train(tc, log=lambda msg: None, need_params=False)
    mngr = manager(ck, keep=3, async_save=False)
    assert read_meta(mngr)["run"]["qat_weight_rule"] == RULE
    mngr.close()
    # the finished run again, now with the default run settings: its export comes from the checkpoint, on its grid
    s = train(tc.replace(export=out), log=lambda msg: None)
    assert s["complete"] and s["export"]["expert_format"] == "mxfp4"
    _assert_on_grid(out, s["params"], RULE)
