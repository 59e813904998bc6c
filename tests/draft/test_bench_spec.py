"""`k3 bench spec --json` at smoke size on k3-tiny with a random-init draft saved as a draft directory: the JSON
object, the named ratios (acceptance lengths in [1, K + 1], a finite positive speed ratio) and greedy exactness; and
every bad input exits 2 before any weight is read, naming the flag (a preset has no shipped draft, a directory that
is not a draft, too few new tokens to time compiled verify steps)."""

import json
import math

import pytest

from k3jax.cli.main import main
from k3jax.draft.measure import CATEGORIES

SMOKE = ["bench", "spec", "--json", "--preset", "k3-tiny", "--smoke-size"]


def test_bench_spec_bad_input_exits_2(tmp_path, capsys):
    assert main(SMOKE) == 2                                     # a preset has no draft/ directory of its own
    assert "no shipped draft" in capsys.readouterr().err
    assert main([*SMOKE, "--draft", str(tmp_path)]) == 2
    assert "not a draft directory" in capsys.readouterr().err
    assert main([*SMOKE, "--draft", "random", "--max-new-tokens", "8"]) == 2     # K = 3: at least 2 (K + 1) + 1
    assert "--max-new-tokens 8" in capsys.readouterr().err
    assert main([*SMOKE, "--draft", "random", "--prompt-len", "1"]) == 2
    assert "--prompt-len" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_spec_smoke_json(tmp_path, capsys):
    from flax import nnx

    from k3jax.config import get_preset
    from k3jax.draft import DraftConfig, DraftModel, save_draft

    cfg = get_preset("k3-tiny")
    dcfg = DraftConfig.for_target(cfg)
    draft = save_draft(tmp_path / "draft", DraftModel(dcfg, rngs=nnx.Rngs(0)), dcfg, dtype="float32")
    assert main([*SMOKE, "--draft", draft]) == 0
    out = json.loads(capsys.readouterr().out)
    K = out["config"]["draft_tokens"]
    assert out["name"] == "spec" and K == 3 and out["config"]["draft"] == draft
    r = out["ratios"]
    for c in CATEGORIES:
        assert 1.0 <= r[f"acceptance_length_{c}"] <= K + 1, r
        assert 1 / (K + 1) <= r[f"target_forwards_per_token_{c}"] <= 1.0, r
        assert math.isfinite(r[f"tokens_per_s_on_over_off_{c}"]) and r[f"tokens_per_s_on_over_off_{c}"] > 0
        on, off = out["categories"][c]["on"], out["categories"][c]["off"]
        assert on["emitted_tokens"] == off["emitted_tokens"] == 2 * 12           # every row to --max-new-tokens
        assert sum(on["accepted_histogram"]) > 1 and off["target_forwards_per_token"] == 1.0
        assert out["exactness"]["rows_equal_without_draft"][c] == 1.0           # greedy: the draft changes no token
    assert math.isfinite(r["tokens_per_s_on_over_off"]) and r["tokens_per_s_on_over_off"] > 0
    assert set(out["config"]["prompt_sha256"]) == set(CATEGORIES)
