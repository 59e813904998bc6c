"""`k3 run`, the README's main job: the shipped k3-mini's held-out loss, a greedy sample and the routing summary;
what it is doing, phase by phase with its seconds, on stderr as it goes; the held-out text named by its sha256 and
the Python whose standard library it is."""

import hashlib
import json
import os
import platform
import re
import subprocess
import sys

import pytest

from k3jax.checkpoint.source import default_ckpt
from k3jax.cli.main import main
from k3jax.cli.run import SAMPLE_PROMPT

SHIPPED = default_ckpt()


# The phases `k3 run` reports on stderr, in order (each line: "k3 run: <what> ... <seconds> s", or with a bar on a
# terminal "k3 run: <what> ...", the bar, "k3 run: <what>: <seconds> s"), then the total.
PHASES = ("loading the model", "reading the held-out text", "compiling the scorer", "scoring", "greedy sample",
          "routing", "writing the routing plots")


@pytest.mark.skipif(SHIPPED is None, reason="the shipped k3-mini is not in this checkout")
def test_main_job_on_the_shipped_model(tmp_path):
    # In a child process as a user runs it (one CPU device, XLA:CPU's default optimisation): the job computes more
    # than it compiles (a 36M-parameter model over 12K bytes), which the suite's 8 simulated devices and -O0 code
    # generation (scripts/test.sh) run ~4x slower (309 s in CI in-process). stderr claims a terminal, so the scoring
    # and routing bars are drawn too.
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if f not in ("--xla_backend_optimization_level=0", "--xla_force_host_platform_device_count=8"))
    argv = ["run", "--heldout-bytes", "8192", "--route-tokens", "4096", "--max-new-tokens", "24", "--plots",
            str(tmp_path), "--json"]
    code = ("import sys; sys.stderr.isatty = lambda: True; from k3jax.cli.main import main; "
            f"sys.exit(main({argv!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "XLA_FLAGS": flags})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # stdout: the one JSON object, nothing else
    ends = re.findall(r"^k3 run: (.*?)(?: \.\.\. |: )\d+\.\d s", r.stderr, re.MULTILINE)  # phases ended
    assert [next((p for p in PHASES if w.startswith(p)), w) for w in ends] == list(PHASES), r.stderr
    assert re.search(r"k3 run: done in \d+\.\d s\n$", r.stderr)
    assert re.search(r"score: 100%.*\| 4/4 ", r.stderr) and "route: 100%" in r.stderr  # the bars
    held = out["heldout_text"]  # the scored bytes named: comparable across machines when these agree
    from k3jax.train import data as tdata
    from k3jax.train.settings import TrainConfig

    tail = tdata.split(tdata.load_corpus(None, max_bytes=TrainConfig().max_bytes), TrainConfig().heldout_frac)[1]
    assert held == {"sha256": hashlib.sha256(tail[:8192].tobytes()).hexdigest(), "bytes": 8192,
                    "python": platform.python_version()}
    assert 0 < out["eval_compile_s"] < out["eval_s"]
    assert out["sample"]["timing"]["decode_tokens_per_s"] > 0 and out["sample"]["timing"]["decode_compile_s"] > 0
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
    assert main(["run", "--preset", "k3-mini", "--heldout-bytes", "2048", "--route-tokens", "1024",
                 "--max-new-tokens", "4", "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "preset k3-mini (random init, seed 0)" in text and "bits/byte" in text
    assert "greedy sample, 4 new bytes" in text
    assert re.search(rf"held-out text: the Python {re.escape(platform.python_version())} standard library, 2,048 "
                     r"bytes, sha256 [0-9a-f]{64} ", text)
    assert text.count("\n") >= 3 + 8  # header lines + one line per MoE layer


@pytest.mark.parametrize("argv,words", [
    (["--preset", "k3-tiny"], "vocab 97 < 256"),
    (["--preset", "k3-mini", "--heldout-bytes", "1"], "--heldout-bytes and --route-tokens must be >= 2"),
    (["--preset", "nope"], "unknown preset"),
    (["--preset", "k3-mini", "--max-new-tokens", "-1"], "--max-new-tokens >= 0"),
])
def test_bad_input_exits_2(argv, words, capsys):
    assert main(["run", *argv]) == 2
    assert words in capsys.readouterr().err


def test_tokens_is_the_old_spelling_of_heldout_bytes(capsys):
    """`k3 run --tokens N` (held-out bytes, while --tokens names a token file everywhere else) is read as
    --heldout-bytes N for one release, with one line saying so (docs/cli.md §4)."""
    assert main(["run", "--preset", "k3-mini", "--tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == ("k3 run: warning: --tokens N is now --heldout-bytes N (--tokens names a token file "
                                   "everywhere else; the old spelling goes away in the next release)")
    assert "--heldout-bytes and --route-tokens must be >= 2, --seq-len and --batch >= 1 (got 1, " in err
    assert main(["run", "--tokens", "2", "--heldout-bytes", "2"]) == 2  # one of the two spellings
    assert "not allowed with argument" in capsys.readouterr().err
