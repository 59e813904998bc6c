"""Decoding studies (`k3 ablate`, ``kind = "decoding"``): the file parses into arms that differ in one decoding key
each, every bad input exits 2 before any weight is read (a two-key arm naming both keys, a change without effect, an
unknown key, a missing draft), the shipped speculative study resolves; and a tiny study runs end to end on k3-tiny
with a random-init draft, its report carrying every column, a second run reading the finished runs back."""

import json
import os

import pytest
from test_ablate_spec import _refused  # the same `--check` refusal helper

from k3jax.ablate import AblationSpecError, DecodingSpec, load, load_spec
from k3jax.ablate.decoding import decoding_of
from k3jax.ablate.decoding_run import decoding_grid
from k3jax.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEAD = """
kind = "decoding"
seeds = 1
[base]
preset = "k3-tiny"
decoding = { draft = false, drafter = "random", draft_tokens = 2 }
[prompts]
count = 2
length = 8
max_new_tokens = 7
[aa]
repeat = true
"""

DRAFT = """
[[factor]]
name = "draft"
keys = ["decoding.draft"]
levels = { off = {}, on = { decoding = { draft = true } } }
"""


def _write(tmp_path, body, head=HEAD, name="study.toml"):
    p = tmp_path / name
    p.write_text(head + body)
    return str(p)


def test_decoding_study_parses_into_one_key_arms(tmp_path, capsys):
    path = _write(tmp_path, """
[[factor]]
name = "draft"
levels = { on = {}, off = { decoding = { draft = false } } }
[[factor]]
name = "rollback"
levels = { copy = { decoding = { draft = true } }, replay = { decoding = { draft = true, rollback = "replay" } } }
""", head=HEAD.replace("draft = false", "draft = true"))
    spec = load(path)
    assert isinstance(spec, DecodingSpec)
    assert list(spec.arms) == ["base", "draft=off", "rollback=replay"]
    assert decoding_of(spec.arms["draft=off"])["draft"] is False
    assert spec.factors[1].base_level == "copy" and spec.factors[1].keys == ("decoding.rollback",)
    assert set(spec.tokens) == {"low_entropy", "high_entropy"} and spec.tokens["low_entropy"].shape == (2, 8)
    assert (spec.tokens["low_entropy"] < 97).all()                       # k3-tiny's vocabulary: bytes % 97
    # the same windows, shuffled per row: the same multiset of tokens, another order
    lo, hi = spec.tokens["low_entropy"], spec.tokens["high_entropy"]
    assert (lo != hi).any() and all(sorted(a) == sorted(b) for a, b in zip(lo.tolist(), hi.tolist()))
    assert [j.label for j in decoding_grid(spec)] == ["base@0", "draft=off@0", "rollback=replay@0", "base@0-aa"]
    assert main(["ablate", path, "--check"]) == 0
    out = capsys.readouterr().out
    assert "decoding.rollback" in out and "'copy' -> 'replay'" in out
    assert load(path).fingerprint == spec.fingerprint                   # a function of the file


def test_two_key_arm_is_refused_naming_both_keys(tmp_path, capsys):
    path = _write(tmp_path, """
[[factor]]
name = "k"
levels = { off = {}, k3 = { decoding = { draft = true, draft_tokens = 3 } } }
""")
    _refused(capsys, path, "level 'k3'", "2 decoding keys", "decoding.draft", "decoding.draft_tokens")


def test_changes_without_effect_and_bad_keys_are_refused(tmp_path, capsys):
    inert = _write(tmp_path, """
[[factor]]
name = "rollback"
levels = { copy = {}, replay = { decoding = { rollback = "replay" } } }
""")
    _refused(capsys, inert, "level 'replay' changes nothing in effect", "decoding.rollback", "the draft is off")
    _refused(capsys, _write(tmp_path, DRAFT.replace("draft = true", "drafts = true")), "unknown key 'drafts'",
             "did you mean 'draft'")
    _refused(capsys, _write(tmp_path, DRAFT.replace('keys = ["decoding.draft"]', 'keys = ["decoding.rollback"]')),
             "changes decoding.draft, not a declared key")
    _refused(capsys, _write(tmp_path, DRAFT.replace("on = { decoding = { draft = true } }", "on = {}")),
             "level 'on' does not change anything")
    _refused(capsys, _write(tmp_path, DRAFT, head=HEAD.replace('drafter = "random"', 'drafter = "nope"')),
             "decoding.drafter", "nope: not a draft directory")
    _refused(capsys, _write(tmp_path, DRAFT, head=HEAD.replace("draft_tokens = 2", "draft_tokens = 0")),
             "draft_tokens: must be >= 1")
    _refused(capsys, _write(tmp_path, DRAFT, head=HEAD.replace("length = 8", "length = 8\nsize = 3")),
             "[prompts]", "unknown key 'size'")
    _refused(capsys, _write(tmp_path, DRAFT, head=HEAD.replace('kind = "decoding"', 'kind = "serving"')),
             "kind", "'serving'")
    with pytest.raises(AblationSpecError, match="a decoding study"):
        load_spec(_write(tmp_path, DRAFT))                              # the training-only loader refuses it


def test_shipped_speculative_study_resolves(tmp_path):
    """experiments/ablations/speculative.toml: draft off (base) vs on at K = 7, A/A; with the shipped draft when it
    exists, else the same file pointed at a random-init draft (the model is read for its config only)."""
    src = os.path.join(REPO, "experiments", "ablations", "speculative.toml")
    text = open(src).read()
    try:
        spec = load(src)
    except AblationSpecError as e:
        assert "no shipped draft" in str(e)
        shipped = os.path.join(REPO, "k3jax", "assets", "k3-mini-stdlib")
        spec = load(_write(tmp_path, text.replace('drafter = "shipped"', 'drafter = "random"')
                           .replace('ckpt = "shipped"', f'ckpt = "{shipped}"'), head=""))
    assert list(spec.arms) == ["base", "draft=on"] and spec.aa["repeat"]
    on, base = decoding_of(spec.arms["draft=on"]), decoding_of(spec.base)
    assert base["draft"] is False and on["draft"] is True and on["draft_tokens"] == 7 and on["greedy"]
    assert {k for k in on if on[k] != base[k]} == {"draft"}
    assert spec.prompts["categories"] == ("low_entropy", "high_entropy") and spec.prompts["max_new_tokens"] == 64


@pytest.mark.slow
def test_tiny_decoding_study_end_to_end(tmp_path, capsys):
    """k3-tiny, a random-init draft at K = 2, 2 prompts x 8 tokens per category, 7 new tokens, A/A: the report's
    columns, greedy exactness (the draft changes no token), and a resumed run that trains nothing new."""
    path = _write(tmp_path, DRAFT)
    out = str(tmp_path / "out")
    # the test suite's compile cache (not the study's own): the tiny programs are shared with other tests
    assert main(["ablate", path, "--out", out, "--json", "--compile-cache", "off"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["schema"] == "k3jax.ablate.decoding/1" and set(r["arms"]) == {"base", "draft=on", "base~aa"}
    for name, a in r["arms"].items():
        for c in ("low_entropy", "high_entropy"):
            x = a["categories"][c]
            assert x["timing"]["tokens_per_s"]["mean"] > 0 and x["timing"]["tokens_per_s_over_base"] > 0
            assert x["rows_equal_base"] == 1.0, (name, c)                   # greedy: a draft changes no token
            if name == "draft=on":
                assert 1.0 <= x["acceptance_length"]["mean"] <= 3.0                # 1 .. K + 1
                assert x["target_forwards_per_token"]["mean"] == pytest.approx(
                    1 / x["acceptance_length"]["mean"], rel=0.5)
            else:
                assert x["acceptance_length"] is None and x["target_forwards_per_token"]["mean"] == 1.0
    assert r["arms"]["draft=on"]["changes"] == {"draft": [False, True]}
    assert r["aa"] == {"repeat": True, "identical": True}
    md = open(os.path.join(out, "results.md")).read()
    for col in ("acceptance length", "target forwards / token", "tokens/s", "x base", "rows = base", "A/A"):
        assert col in md
    assert sorted(os.listdir(os.path.join(out, "runs", "base"))) == ["seed-0", "seed-0-aa"]
    before = os.path.getmtime(os.path.join(out, "runs", "draft=on", "seed-0", "result.json"))
    assert main(["ablate", path, "--out", out, "--json", "--compile-cache", "off"]) == 0        # resumes: reads back
    again = json.loads(capsys.readouterr().out)
    assert os.path.getmtime(os.path.join(out, "runs", "draft=on", "seed-0", "result.json")) == before
    assert again["arms"]["draft=on"]["categories"] == r["arms"]["draft=on"]["categories"]
    other = _write(tmp_path, DRAFT, head=HEAD.replace("max_new_tokens = 7", "max_new_tokens = 9"), name="other.toml")
    assert main(["ablate", other, "--out", out, "--compile-cache", "off"]) == 2     # another study's directory
    assert "holds the results of a different ablation file" in capsys.readouterr().err
