"""README.md's "Quick start in Python" runs as written: the block between its quick-start markers, executed in a
fresh Python process (one CPU device, as a user's session has), loads the shipped k3-mini, runs ``forward`` and
``generate``, and prints the continuation."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3jax.checkpoint.load import shipped_checkpoint

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"<!-- quick-start: begin -->\n```python\n(.*?)```\n<!-- quick-start: end -->", re.DOTALL)

# Run after the README's block, in the same process: what it computed, checked.
CHECK = """
import json
assert logits.shape == (1, prompt.shape[1], cfg.vocab_size), logits.shape
first = int(np.argmax(np.asarray(logits)[0, -1]))
print(json.dumps({"first": int(out.tokens[0, 0]), "argmax": first, "tokens": out.tokens[0].tolist(),
                  "timing": out.timing}))
"""


def readme_snippet() -> str:
    found = BLOCK.findall(README.read_text(encoding="utf-8"))
    assert len(found) == 1, "README.md needs exactly one quick-start block (a python fence between the markers)"
    return found[0]


@pytest.mark.skipif(shipped_checkpoint() is None, reason="the shipped k3-mini is not in this checkout")
def test_readme_quick_start_runs_as_written():
    import json

    code = readme_snippet()
    assert "forward" in code and "generate(" in code and "load(" in code
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONIOENCODING": "utf-8",  # one device; the suite's -O0 kept
           "XLA_FLAGS": re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))}
    r = subprocess.run([sys.executable, "-c", code + CHECK], capture_output=True, env=env, timeout=600,
                       cwd=README.parent)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-4000:]
    printed, _, last = r.stdout.rstrip(b"\n").rpartition(b"\n")
    got = json.loads(last)
    assert len(got["tokens"]) == 24 and min(got["tokens"]) >= 0            # greedy, no stop: every byte drawn
    assert printed.decode() == bytes(got["tokens"]).decode("utf-8", errors="replace")  # the README's print
    assert got["first"] == got["argmax"]  # the first greedy byte is the arg-max of forward's last logits
    assert got["timing"]["decode_tokens_per_s"] > 0
