"""`k3 run`, the README's main job: the shipped k3-mini's held-out loss, a greedy sample and the routing summary
(issues #17, #34)."""

import json

import pytest

from k3jax.cli.main import main
from k3jax.cli.run import SAMPLE_PROMPT
from k3jax.cli.source import default_ckpt

SHIPPED = default_ckpt()


@pytest.mark.skipif(SHIPPED is None, reason="the shipped k3-mini is not in this checkout")
def test_main_job_on_the_shipped_model(tmp_path, capsys):
    assert main(["run", "--tokens", "8192", "--route-tokens", "4096", "--max-new-tokens", "24", "--plots",
                 str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == SHIPPED and out["config"] == "hf-kimi_k3"
    sample = out["sample"]  # greedy, no stop ids: exactly the bytes asked for, continuing the fixed prompt
    assert sample["prompt"] == SAMPLE_PROMPT and len(sample["tokens"]) == 24
    assert sample["text"] == bytes(sample["tokens"]).decode("utf-8", errors="replace") and sample["text"].strip()
    assert out["heldout_tokens_scored"] > 8000 and out["routed_tokens"] == 4096
    assert out["heldout_nats_per_byte"] < 1.6 < out["unigram_entropy_nats"]  # trained, far below the unigram
    assert [r["layer"] for r in out["routing"]] == list(range(1, 9))
    for r in out["routing"]:
        assert r["max_over_mean_load"] >= 1.0 and 0 <= r["experts_unused"] < 32
    assert len(out["plots"]) == 5 and all((tmp_path / p.rsplit("/", 1)[-1]).stat().st_size > 500
                                          for p in out["plots"])


@pytest.mark.slow
def test_random_init_preset_and_text_output(capsys):
    assert main(["run", "--preset", "k3-mini", "--tokens", "2048", "--route-tokens", "1024", "--max-new-tokens", "4",
                 "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "preset k3-mini (random init, seed 0)" in text and "bits/byte" in text
    assert "greedy sample, 4 new bytes" in text
    assert text.count("\n") >= 3 + 8  # header lines + one line per MoE layer


@pytest.mark.parametrize("argv,words", [
    (["--preset", "k3-tiny"], "vocab 97 < 256"),
    (["--preset", "k3-mini", "--tokens", "1"], "--tokens and --route-tokens must be >= 2"),
    (["--preset", "nope"], "unknown preset"),
    (["--preset", "k3-mini", "--max-new-tokens", "-1"], "--max-new-tokens >= 0"),
])
def test_bad_input_exits_2(argv, words, capsys):
    assert main(["run", *argv]) == 2
    assert words in capsys.readouterr().err
