"""k3jax.tokenizer: Kimi's tiktoken BPE from a checkpoint directory (a small BPE file written here), bytes else."""

import base64
import json

import numpy as np
import pytest

from k3jax.tokenizer import (
    KIMI_PATTERN,
    ByteTokenizer,
    KimiTokenizer,
    TokenizerError,
    load_tokenizer,
    pattern_from_source,
)

# K2's tokenization_kimi.py states its pattern like this (a class attribute built with "|".join); only its syntax
# tree is read.
KIMI_SOURCE = '''
import tiktoken
raise RuntimeError("this file must never be executed")

class TikTokenTokenizer:
    special_tokens = {}
    pat_str = "|".join(
        [
            r"""[\\p{Han}]+""",
            r"""[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\\p{N}{1,3}""",
            r""" ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*""",
            r"""\\s*[\\r\\n]+""",
            r"""\\s+(?!\\S)""",
            r"""\\s+""",
        ]
    )
'''
MERGES = [b"th", b"the", b" t", b" the", b"in", b"ing", b"\xe4\xb8", "中".encode(), b"  "]


def write_tokenizer(d, merges=MERGES, specials=None, source=KIMI_SOURCE):
    ranks = [bytes([i]) for i in range(256)] + merges
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    n = len(ranks)
    specials = specials or {n: "[BOS]", n + 1: "[EOS]", n + 3: "<|im_end|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(i): {"content": s, "special": True} for i, s in specials.items()}}))
    if source is not None:
        (d / "tokenization_kimi.py").write_text(source)
    return n


def test_pattern_from_the_shipped_source_equals_spec(tmp_path):
    write_tokenizer(tmp_path)
    assert pattern_from_source(str(tmp_path / "tokenization_kimi.py")) == KIMI_PATTERN


def test_round_trip_text_and_special_tokens(tmp_path):
    n = write_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path), vocab_size=n + 8)
    assert isinstance(tok, KimiTokenizer) and tok.vocab_size == n + 8
    text = "the thing 中文 It's 12345\n\n  end<|im_end|>[EOS]"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[-2:] == [n + 3, n + 1]  # special tokens encode as their ids
    assert 256 + MERGES.index(b"the") in ids and 256 + MERGES.index("中".encode()) in ids  # merges apply
    assert "\n\n" not in [tok.token_bytes(i).decode("utf-8", "replace") for i in ids[:3]]
    # ids the config does not name are reserved tokens, as in Kimi's wrapper
    assert tok.special_tokens[f"<|reserved_token_{n + 2}|>"] == n + 2
    assert tok.decode([n + 7]) == f"<|reserved_token_{n + 7}|>"


def test_split_pattern_groups_digits_in_threes(tmp_path):
    # merges "12", "34", "123": with Kimi's \p{N}{1,3} split, "1234" is the pieces "123" + "4" -> [123, "4"];
    # BPE over the unsplit string would give ["12", "34"]
    n = write_tokenizer(tmp_path, merges=[b"12", b"34", b"123"])
    tok = KimiTokenizer.from_dir(str(tmp_path), vocab_size=n + 4)
    assert tok.encode("1234") == [258, ord("4")]
    assert tok.encode(" 34") == [ord(" "), 257]  # the space is its own piece before digits


def test_missing_source_falls_back_to_spec_pattern(tmp_path):
    n = write_tokenizer(tmp_path, source=None)
    assert KimiTokenizer.from_dir(str(tmp_path), vocab_size=n + 4).pattern == KIMI_PATTERN


def test_bytes_without_a_tokenizer_file(tmp_path):
    tok = load_tokenizer(str(tmp_path), vocab_size=256)
    assert isinstance(tok, ByteTokenizer) and tok.encode("aé") == [97, 0xC3, 0xA9]
    assert tok.decode([97, 0xC3, 0xA9]) == "aé"
    with pytest.raises(TokenizerError, match="at least 256"):
        load_tokenizer(None, vocab_size=97)


@pytest.mark.parametrize("line,words", [("!!notbase64 1\n", "not base64"), ("YQ==\n", "expected 'base64 rank'"),
                                        ("YQ== 0\nYQ== 1\n", "appears twice"), ("YQ== 5\n", "ranks must be 0..0")])
def test_malformed_ranks_file(tmp_path, line, words):
    (tmp_path / "tiktoken.model").write_text(line)
    with pytest.raises(TokenizerError, match=words):
        load_tokenizer(str(tmp_path), vocab_size=300)


def test_tokenizer_larger_than_the_model_is_refused(tmp_path):
    n = write_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="special token ids must lie"):
        load_tokenizer(str(tmp_path), vocab_size=n + 2)  # <|im_end|> at n + 3 does not fit


def test_route_text_uses_the_checkpoint_tokenizer(tmp_path, capsys):
    from k3jax.checkpoint.save import save
    from k3jax.cli.main import main
    from k3jax.config import get_preset
    from k3jax.testing import random_params

    n = 256 + len(MERGES)
    cfg = get_preset("k3-tiny", vocab_size=n + 8)
    save(random_params(cfg), cfg, tmp_path / "ck")
    write_tokenizer(tmp_path / "ck")
    (tmp_path / "t.txt").write_text("the thing in the ring<|im_end|>" * 5)
    assert main(["route", "--ckpt", str(tmp_path / "ck"), "--text", str(tmp_path / "t.txt"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    want = len(KimiTokenizer.from_dir(str(tmp_path / "ck"), n + 8).encode((tmp_path / "t.txt").read_text()))
    assert rep["tokens"] == want < len((tmp_path / "t.txt").read_bytes())
    assert np.sum(rep["layers"][0]["load"]) == want * cfg.num_experts_per_token
