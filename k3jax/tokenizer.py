"""The one tokenizer module: the Kimi releases' tiktoken BPE (docs/model.md §1.1a), or bytes for the presets.

    tok = load_tokenizer("Kimi-K3/")          # tiktoken.model + tokenizer_config.json (+ tokenization_kimi.py)
    ids = tok.encode("def f(x):")             # list[int]; special tokens such as <|im_end|> are recognised
    tok.decode(ids)

A checkpoint directory with ``tiktoken.model`` gets a ``KimiTokenizer``: the ranks file is parsed directly (one
``base64(token bytes) rank`` pair a line; not ``tiktoken.load``, whose cache keyed by path can return a stale file),
special tokens come from ``tokenizer_config.json``'s ``added_tokens_decoder``, and the ids between the BPE
vocabulary and the model's vocabulary that it does not name become ``<|reserved_token_{id}|>`` (the 256 ids
163584..163839 of K3). The split pattern is read from the checkpoint's ``tokenization_kimi.py`` by parsing its
syntax tree — never importing it — and falls back to docs/model.md §1.1a's ``KIMI_PATTERN``. Without ``tiktoken.model``
the text is UTF-8 bytes (``ByteTokenizer``, ids 0..255), which is what the presets and the shipped k3-mini use.
"""

from __future__ import annotations

import ast
import base64
import json
import os

from k3jax.errors import InputError

# docs/model.md §1.1a (K2's tokenization_kimi.py), one alternative per entry, joined with "|".
KIMI_PATTERN_PARTS = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PATTERN = "|".join(KIMI_PATTERN_PARTS)
RANKS_FILE, CONFIG_FILE, CODE_FILE = "tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py"


class TokenizerError(InputError):
    """A malformed tokenizer file; the message names the file and line."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 (the presets' byte-level vocabularies)."""

    name = "bytes"
    special_tokens: dict[str, int] = {}

    def __init__(self, vocab_size: int = 256):
        if vocab_size < 256:
            raise TokenizerError(f"a byte-level text needs a vocabulary of at least 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        return bytes([i]) if 0 <= i < 256 else b""


def read_ranks(path: str) -> dict[bytes, int]:
    """``tiktoken.model``: ``base64 rank`` per line → {token bytes: rank}; ranks must be 0..n-1, each once."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise TokenizerError(f"{path}:{n}: expected 'base64 rank', got {line[:60]!r}")
            try:
                tok = base64.b64decode(parts[0], validate=True)
            except ValueError:
                raise TokenizerError(f"{path}:{n}: not base64: {parts[0][:40]!r}") from None
            if tok in ranks:
                raise TokenizerError(f"{path}:{n}: token {tok!r} appears twice")
            ranks[tok] = int(parts[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1}, each exactly once")
    return ranks


def pattern_from_source(path: str) -> str | None:
    """The ``pat_str`` of a ``tokenization_kimi.py``, read from its syntax tree (the file is never imported or
    executed): an assignment ``pat_str = "|".join([<string literals>])`` or ``pat_str = "<literal>"``; None if
    there is none."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names = [t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", None) for t in targets]
        if "pat_str" not in names or node.value is None:
            continue
        v = node.value
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            return v.value
        if (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "join"
                and isinstance(v.func.value, ast.Constant) and isinstance(v.args[0], ast.List | ast.Tuple)
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.args[0].elts)):
            return v.func.value.value.join(e.value for e in v.args[0].elts)
    return None


class KimiTokenizer:
    """tiktoken BPE with Kimi's split pattern and special tokens (docs/model.md §1.1a)."""

    name = "tiktoken"

    def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int], pattern: str = KIMI_PATTERN,
                 vocab_size: int | None = None):
        import tiktoken

        self.n_bpe = len(ranks)
        self.vocab_size = vocab_size or self.n_bpe + len(special_tokens)
        clash = {s: i for s, i in special_tokens.items() if i < self.n_bpe or i >= self.vocab_size}
        if clash:
            raise TokenizerError(f"special token ids must lie in [{self.n_bpe}, {self.vocab_size}): {clash}")
        self.special_tokens = dict(special_tokens)
        self.pattern = pattern
        self._enc = tiktoken.Encoding("kimi", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_tokens)
        self._special_by_id = {i: s for s, i in special_tokens.items()}

    @classmethod
    def from_dir(cls, path: str, vocab_size: int | None = None) -> KimiTokenizer:
        ranks = read_ranks(os.path.join(path, RANKS_FILE))
        special: dict[str, int] = {}
        cfg_path = os.path.join(path, CONFIG_FILE)
        if os.path.exists(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    atd = json.load(f).get("added_tokens_decoder", {})
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from None
            for i, spec in atd.items():
                if not str(i).isdigit() or not isinstance(spec, dict) or not isinstance(spec.get("content"), str):
                    raise TokenizerError(f"{cfg_path}: added_tokens_decoder[{i!r}] must map an id to "
                                         "{'content': str, ...}")
                special[spec["content"]] = int(i)
        top = vocab_size or max([len(ranks) - 1, *special.values()]) + 1
        named = set(special.values())
        for i in range(len(ranks), top):  # ids the config does not name are reserved, as in Kimi's wrapper
            if i not in named:
                special[f"<|reserved_token_{i}|>"] = i
        code = os.path.join(path, CODE_FILE)
        pattern = (pattern_from_source(code) if os.path.exists(code) else None) or KIMI_PATTERN
        return cls(ranks, special, pattern, top)

    def encode(self, text: str) -> list[int]:
        """Text → ids; special-token strings in the text are encoded as their ids."""
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def token_bytes(self, i: int) -> bytes:
        if i in self._special_by_id:
            return self._special_by_id[i].encode()
        return self._enc.decode_single_token_bytes(int(i))


def load_tokenizer(path: str | None, vocab_size: int):
    """The checkpoint's own tokenizer when ``path`` holds ``tiktoken.model``, else bytes (needs vocab >= 256)."""
    if path and os.path.exists(os.path.join(path, RANKS_FILE)):
        tok = KimiTokenizer.from_dir(path, vocab_size)
        if tok.vocab_size > vocab_size:
            raise TokenizerError(f"{path}: the tokenizer has {tok.vocab_size} ids, the model {vocab_size}")
        return tok
    return ByteTokenizer(vocab_size)


__all__ = ["ByteTokenizer", "KIMI_PATTERN", "KIMI_PATTERN_PARTS", "KimiTokenizer", "TokenizerError",
           "load_tokenizer", "pattern_from_source", "read_ranks"]
