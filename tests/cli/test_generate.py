"""`k3 generate` (k3jax/cli/generate.py, k3jax/model/generate.py): greedy decoding agrees with the full forward and
with HF transformers' own cached greedy generation on a checkpoint it wrote; same seed, same samples; stop ids;
the checkpoint's tokenizer; compile time reported apart from the decode throughput; bad input exits 2 and writes
nothing."""

import base64
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.model.functional import forward, init_params
from k3jax.model.generate import CompileClock, Sampling, sample

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "kimi_linear")


def _gen(tmp_path, *args, name="g"):
    out, lg = tmp_path / f"{name}.npy", tmp_path / f"{name}_logits.npy"
    rc = main(["generate", *args, "--out", str(out), "--logits-out", str(lg)])
    assert rc == 0
    return np.load(out), np.load(lg)


def _ragged(rows):
    t = np.full((len(rows), max(map(len, rows))), -1, np.int32)
    for i, r in enumerate(rows):
        t[i, : len(r)] = r
    return t


@pytest.mark.slow  # 54 s (CI's budget, session 9)
def test_greedy_equals_the_full_forward(tmp_path, capsys):
    """Each greedy token is the arg-max of the full forward over prompt + the tokens before it, and the logits
    written are that forward's (ragged prompts, one row stopping early)."""
    cfg = get_preset("k3-tiny")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, n).tolist() for n in (5, 1, 12)]
    np.save(tmp_path / "p.npy", _ragged(prompts))
    toks, logits = _gen(tmp_path, "--preset", "k3-tiny", "--tokens", str(tmp_path / "p.npy"), "--greedy",
                        "--max-new-tokens", "6", "--json")
    out = json.loads(capsys.readouterr().out)
    assert toks.shape == (3, 6) and toks.dtype == np.int32 and logits.shape == (3, 6, 97)
    params = init_params(cfg, jax.random.key(0))                        # --preset: init seed 0
    seqs = _ragged([p + toks[b].tolist() for b, p in enumerate(prompts)])
    full = np.asarray(forward(params, jnp.asarray(np.maximum(seqs, 0)), cfg))  # causal: the padding comes after
    for b, p in enumerate(prompts):
        ref = full[b, len(p) - 1: len(p) - 1 + toks.shape[1]]
        np.testing.assert_allclose(logits[b], ref, rtol=0, atol=1e-4 * np.abs(ref).max())
        assert (np.argmax(ref, -1) == toks[b]).all()
        assert out["rows"][b]["tokens"] == toks[b].tolist() and out["rows"][b]["stop_reason"] == "length"
        assert out["rows"][b]["prompt_tokens"] == len(p)
    # --stop with row 0's third greedy token: row 0 ends there, the others run on unchanged
    stop = int(toks[0, 2])
    toks2, logits2 = _gen(tmp_path, "--preset", "k3-tiny", "--tokens", str(tmp_path / "p.npy"), "--greedy",
                          "--max-new-tokens", "6", "--stop", str(stop), "--json", name="s")
    out2 = json.loads(capsys.readouterr().out)
    first = int(np.argmax(toks[0] == stop))
    assert toks2[0, : first + 1].tolist() == toks[0, : first + 1].tolist() and (toks2[0, first + 1:] == -1).all()
    assert (logits2[0, first + 1:] == 0).all() and out2["rows"][0]["stop_reason"] == "stop"
    for b in (1, 2):
        if stop not in toks[b]:
            np.testing.assert_array_equal(toks2[b], toks[b])


def test_same_seed_same_samples(tmp_path, capsys):
    np.save(tmp_path / "p.npy", np.array([[3, 1, 4, 1, 5], [9, 2, 6, -1, -1]], np.int32))
    args = ["--preset", "k3-tiny", "--tokens", str(tmp_path / "p.npy"), "--temperature", "1.5", "--top-p", "0.95",
            "--top-k", "40", "--max-new-tokens", "8"]
    a, _ = _gen(tmp_path, *args, "--seed", "1", name="a")
    b, _ = _gen(tmp_path, *args, "--seed", "1", name="b")
    c, _ = _gen(tmp_path, *args, "--seed", "2", name="c")
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_compile_clock():
    """Seconds JAX spends compiling, nested spans counted once; a cached call adds none."""
    f = jax.jit(lambda x: jnp.sin(x) * 2)
    with CompileClock() as clock:
        f(jnp.ones(3)).block_until_ready()
        n = len(clock)
        f(jnp.ones(3)).block_until_ready()
    assert n >= 1 and len(clock) == n and clock.seconds() > 0
    clock.spans = [(0.0, 2.0), (1.0, 3.0), (1.5, 2.5), (5.0, 6.0)]
    assert clock.seconds() == 4.0 and clock.seconds(3) == 1.0


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    key = jax.random.key(0)
    top_k = np.asarray(sample(logits, key, Sampling(greedy=False, top_k=2)))
    assert set(top_k.tolist()) == {0, 1} and abs(np.mean(top_k == 0) - 0.5 / 0.8) < 0.03
    top_p = np.asarray(sample(logits, key, Sampling(greedy=False, top_p=0.7)))   # keeps 0.5 + 0.3 (reaches 0.7)
    assert set(top_p.tolist()) == {0, 1}
    tiny = np.asarray(sample(logits, key, Sampling(greedy=False, top_p=0.1)))    # the most likely always stays
    assert set(tiny.tolist()) == {0}
    assert np.asarray(sample(logits[:2], key, Sampling())).tolist() == [0, 0]


def test_greedy_reproduces_transformers_cached_generation(tmp_path):
    """tests/golden/kimi_linear: a Kimi-Linear checkpoint written by transformers 5.23 and its own cached greedy
    generation (make_golden.py). All three prompts (1, 7 and 70 tokens) decode together as one ragged batch."""
    g = np.load(os.path.join(GOLDEN, "golden.npz"), allow_pickle=False)
    n = sum(1 for k in g.files if k.startswith("prompt_"))
    prompts = [g[f"prompt_{i}"].reshape(-1).tolist() for i in range(n)]
    N = g["generated_0"].reshape(-1).shape[0]
    np.save(tmp_path / "p.npy", _ragged(prompts))
    toks, logits = _gen(tmp_path, "--ckpt", os.path.join(GOLDEN, "ckpt"), "--tokens", str(tmp_path / "p.npy"),
                        "--greedy", "--max-new-tokens", str(N))
    for i in range(n):
        np.testing.assert_array_equal(toks[i], g[f"generated_{i}"].reshape(-1), err_msg=f"prompt {i}")
        diff = np.abs(logits[i] - g[f"step_logits_{i}"].reshape(N, -1)).max()
        print(f"prompt {i} ({len(prompts[i])} tokens): max |logits - transformers| = {diff:.2e}")
        assert diff <= 1e-4


def _tokenizer_dir(d, vocab):
    """A small Kimi-style tiktoken BPE (ranks + special tokens) in ``d``."""
    merges = [b"th", b"the", b" t", b" the", b"in", b"ing"]
    ranks = [bytes([i]) for i in range(256)] + merges
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(len(ranks)): {"content": "<|im_end|>", "special": True}}}))
    assert len(ranks) + 1 <= vocab


@pytest.mark.slow  # CI's budget (session 23): --prompt's bad-input cases stay in the default suite
def test_prompt_text_uses_the_checkpoint_tokenizer_and_streams(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(GOLDEN, "ckpt"), ckpt)
    _tokenizer_dir(ckpt, 512)
    args = ["generate", "--ckpt", str(ckpt), "--prompt", "the thing<|im_end|>", "--max-new-tokens", "3"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokenizer"] != "bytes"
    assert out["rows"][0]["prompt_tokens"] == 5         # "the", " th", "ing", "<|im_end|>" ... not 19 bytes
    t = out["timing"]  # a first call at these shapes: the prefill and the first decode step compile
    assert 0 < t["prefill_compile_s"] <= t["prefill_s"] and 0 < t["decode_compile_s"] <= t["first_step_s"]
    assert t["decode_steps"] == 2 and t["decode_tokens_per_s"] == pytest.approx(1 / (t["decode_s"] - t["first_step_s"]))
    assert main(args) == 0                             # B = 1 without --json: the text streams to stdout
    captured = capsys.readouterr()
    streamed = captured.out
    assert streamed.startswith("the thing<|im_end|>") and streamed.endswith(out["rows"][0]["text"] + "\n")
    assert captured.err.count("(compile 0.00 s") == 2 and "tokens/s after compile" in captured.err  # all cached


@pytest.mark.parametrize("args, rows, match", [
    (["--prompt", "x", "--temperature", "1", "--top-p", "1.5"], None, "top-p"),
    (["--prompt", "x", "--temperature", "1", "--top-p", "0"], None, "top-p"),
    (["--prompt", ""], None, "empty"),
    (["--preset", "k3-tiny", "--prompt", "x"], None, "needs a tokenizer"),
    (["--prompt", "abcdef", "--max-len", "8"], None, "exceeds the maximum length 8"),
    (["--tokens"], [[1, 600]], "token id 600 >= vocab 512"),
    (["--tokens"], [[-1, -1]], "empty"),
    (["--tokens"], [[1, -1, 2]], "right padding"),
    (["--prompt", "x", "--stop", "a"], None, "--stop"),
    (["--prompt", "x", "--max-new-tokens", "0"], None, "max-new-tokens"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, rows, match):
    if rows is not None:
        np.save(tmp_path / "t.npy", np.array(rows, np.int32))
        args = [*args, str(tmp_path / "t.npy")]
    out = tmp_path / "g.npy"
    rc = main(["generate", "--preset", "kimi-linear-tiny", *args, "--out", str(out),
               "--logits-out", str(tmp_path / "l.npy")])
    assert rc == 2
    assert match in capsys.readouterr().err
    assert not list(tmp_path.glob("g.npy*")) and not list(tmp_path.glob("l.npy*"))
