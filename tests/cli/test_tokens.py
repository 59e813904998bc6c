"""One meaning of ``--tokens`` (docs/cli.md; k3jax/checkpoint/source.py ``load_token_file``): int32 [B, T] is B
independent sequences right-padded with -1, [T] one stream. Bad ids, empty rows and padding inside a row exit 2 in
`k3 route`, `k3 logits` and `k3 generate` alike, naming the flag, file and row, before any compute: nothing written.
(Routing of good files: tests/analysis/test_collect.py; logits of ragged rows: tests/checkpoint/test_export.py.)"""

import os

import numpy as np
import pytest

from k3jax.checkpoint.save import config_json
from k3jax.checkpoint.source import load_token_file
from k3jax.cli.main import main
from k3jax.config import get_preset
from k3jax.errors import InputError

CFG = get_preset("k3-tiny")  # vocab 97

BAD = {  # rows, what the message says
    "negative": ([[1, 2, 3], [4, -3, 5]], "row 1, position 1: token id -3 is negative"),
    "vocab": ([[1, 2, 3], [4, 5, 97]], "row 1, position 2: token id 97 >= vocab 97"),
    "only-padding": ([[1, 2, 3], [-1, -1, -1]], "row 1 is empty (only -1 padding)"),
    "inner-padding": ([[1, -1, 2], [4, 5, 6]], "row 0: -1 at position 1 is followed by token id 2 at position 2"),
}


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A k3-tiny checkpoint directory with only its config.json: `k3 logits` must refuse the tokens before it
    reads a weight (there is none to read)."""
    d = tmp_path_factory.mktemp("cfg") / "tiny"
    d.mkdir()
    (d / "config.json").write_bytes(config_json(CFG))
    return str(d)


def _argv(command, ckpt, tokens, out):
    return {"route": ["route", "--preset", "k3-tiny", "--tokens", tokens, "--plots", out, "--json"],
            "logits": ["logits", ckpt, "--tokens", tokens, "--out", out],
            "generate": ["generate", "--preset", "k3-tiny", "--tokens", tokens, "--out", out, "--logits-out",
                         out + ".logits.npy"]}[command]


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("command", ["route", "logits", "generate"])
def test_bad_tokens_exit_2_naming_the_row_and_write_nothing(config_only, tmp_path, capsys, command, kind):
    rows, words = BAD[kind]
    tokens = str(tmp_path / "t.npy")
    np.save(tokens, np.array(rows, np.int32))
    out = str(tmp_path / "out")
    assert main(_argv(command, config_only, tokens, out)) == 2
    err = capsys.readouterr().err
    assert f"k3 {command}: error: --tokens {tokens}: {words}" in err
    assert sorted(os.listdir(tmp_path)) == ["t.npy"]                  # no --out, --logits-out or --plots DIR


@pytest.mark.parametrize("make, words", [
    (lambda p: np.save(p, np.array([[1.0, 2.0]])), "token ids must be integers, got dtype float64"),
    (lambda p: np.save(p, np.zeros((1, 2, 3), np.int32)), "expected [B, T] (B sequences) or [T] (one stream)"),
    (lambda p: np.save(p, np.zeros((0, 4), np.int32)), "no rows"),
    (lambda p: np.save(p, np.array([[1], [object()]], object), allow_pickle=True), "without unpickling"),
    (lambda p: np.save(p, np.array([3, -1, 4], np.int32)), "the [T] stream: -1 at position 1"),
], ids=["float", "3-d", "no-rows", "pickle", "stream-inner-padding"])
def test_reader_refuses_naming_flag_and_file(tmp_path, make, words):
    p = str(tmp_path / "t.npy")
    make(p)
    with pytest.raises(InputError) as e:
        load_token_file(p, CFG.vocab_size, flag="--tokens")
    assert str(e.value).startswith(f"--tokens {p}: ") and words in str(e.value)


def test_reader_rows_lengths_and_stream(tmp_path):
    p = str(tmp_path / "t.npy")
    np.save(p, np.array([[5, 6, -1], [7, -1, -1]], np.int64))
    r = load_token_file(p, CFG.vocab_size)
    assert r.tokens.dtype == np.int32 and r.lengths.tolist() == [2, 1] and not r.stream
    assert r.mask.tolist() == [[True, True, False], [True, False, False]]
    np.save(p, np.array([5, 6, 7, -1], np.int16))
    r = load_token_file(p, CFG.vocab_size)
    assert r.stream and r.tokens.shape == (1, 4) and r.lengths.tolist() == [3]
