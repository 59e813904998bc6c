"""`k3 generate --draft` (k3jax/cli/generate.py, k3jax/draft/speculative.py): on a k3-tiny checkpoint with packed
MXFP4 experts and a freshly initialised draft written in the draft's HF layout, greedy with the draft emits the
tokens of greedy without it (where the plain run's top-2 margin exceeds 1e-3) and --logits-out gives the same
logits (1e-5 relative), under either rollback; a draft for another model, --draft-tokens outside [1, block size]
and the speculative flags without --draft exit 2 naming the field or flag, before any compute, writing nothing."""

import numpy as np
import pytest
from flax import nnx

from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.draft.config import DraftConfig
from k3jax.draft.io import save_draft
from k3jax.draft.network import DraftModel
from k3jax.testing import assert_same_greedy


def _draft(d, preset, **kw):
    dcfg = DraftConfig.for_target(get_preset(preset) if isinstance(preset, str) else preset, **kw)
    return save_draft(str(d), DraftModel(dcfg, rngs=nnx.Rngs(1)), dcfg, dtype="float32")


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return _draft(tmp_path_factory.mktemp("draft") / "d", "k3-tiny")


def _gen(tmp_path, name, *args):
    out, lg = tmp_path / f"{name}.npy", tmp_path / f"{name}_logits.npy"
    assert main(["generate", *args, "--out", str(out), "--logits-out", str(lg)]) == 0
    return np.load(out), np.load(lg)


@pytest.mark.parametrize("rollback", ["replay"])
def test_greedy_with_a_draft_reproduces_greedy(tiny, draft, tmp_path, rollback):
    ckpt, tokens = tiny
    common = ["--ckpt", ckpt, "--tokens", tokens, "--greedy", "--max-new-tokens", "9"]
    plain, plain_logits = _gen(tmp_path, "plain", *common)
    spec, spec_logits = _gen(tmp_path, "spec", *common, "--draft", draft, "--draft-tokens", "3",
                             "--rollback", rollback)
    assert_same_greedy(spec, spec_logits, plain, plain_logits)


@pytest.mark.parametrize("extra,match", [
    (["--draft-tokens", "0"], "--draft-tokens must be >= 1"),
    (["--draft-tokens", "8"], "exceeds the draft's block size 7"),
])
def test_bad_draft_tokens_exit_2(tiny, draft, tmp_path, capsys, extra, match):
    ckpt, tokens = tiny
    out = tmp_path / "o.npy"
    rc = main(["generate", "--ckpt", ckpt, "--tokens", tokens, "--draft", draft, *extra, "--out", str(out)])
    assert rc == 2 and match in capsys.readouterr().err and not out.exists()


def test_speculative_flags_need_a_draft(tiny, tmp_path, capsys):
    ckpt, tokens = tiny
    assert main(["generate", "--ckpt", ckpt, "--tokens", tokens, "--rollback", "replay"]) == 2
    assert "--rollback needs --draft" in capsys.readouterr().err


@pytest.mark.parametrize("preset,kw,field", [
    ("kimi-linear-tiny", {}, "vocab_size"),                  # another model altogether
    ("k3-tiny", {"target_layer_ids": (0, 9)}, "target_layer_ids"),   # a tap beyond the target's 5 layers
    (get_preset("k3-tiny").replace(num_experts=16), {}, "target_config_hash"),  # same sizes, another arch
], ids=["other_model", "tap_beyond_depth", "other_architecture"])
def test_a_draft_for_another_model_exits_2_naming_the_field(tiny, tmp_path, capsys, preset, kw, field):
    ckpt, tokens = tiny
    try:
        bad = _draft(tmp_path / "bad", preset, **kw)
    except Exception as e:                             # the config itself refuses the taps: the same field named
        assert field in str(e)
        return
    out = tmp_path / "o.npy"
    rc = main(["generate", "--ckpt", ckpt, "--tokens", tokens, "--draft", bad, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and field in err and not out.exists(), err
