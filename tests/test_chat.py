"""k3jax.chat: templates rendered in the sandbox, the assistant-only target mask, chat JSONL, the shipped SFT set."""

import importlib.util
import json
import os
import re

import numpy as np
import pytest

from k3jax.chat import (
    BUILTIN_TEMPLATE,
    encode_chat,
    load_template,
    read_chat_jsonl,
    render,
    sniff_jsonl,
    template_for,
)
from k3jax.errors import InputError
from k3jax.tokenizer import ByteTokenizer, KimiTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = os.path.join(ROOT, "experiments", "sft")

CONVO = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": "2+3"},
    {"role": "assistant", "content": "5"},
]
MULTI = [
    {"role": "user", "content": "Reverse: cat"},
    {"role": "assistant", "content": "tac"},
    {"role": "user", "content": "Uppercase: dog"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "DOG ü"},  # a two-byte character: spans are counted in bytes
]
# Kimi K2's layout with its special tokens (the shape of tokenizer_config.json's chat_template, shortened).
KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
KIMI_SPECIALS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")


def kimi_tokenizer(merges=(b"th", b"the", b"us", b"user", b"as", b"ant", b"DO", b"DOG", b"ac")):
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + r for r, m in enumerate(merges)}
    n = len(ranks)
    return KimiTokenizer(ranks, {s: n + j for j, s in enumerate(KIMI_SPECIALS)})


def target_text(tok, ids, target):
    """The target tokens' text, runs joined by '|' (one run per assistant turn)."""
    runs, cur = [], b""
    for i, t in zip(ids.tolist(), target.tolist()):
        if t:
            cur += tok.token_bytes(i)
        elif cur:
            runs, cur = runs + [cur], b""
    return "|".join(r.decode() for r in runs + ([cur] if cur else []))


def test_builtin_template_renders_the_expected_text():
    assert render(CONVO, BUILTIN_TEMPLATE) == "<|system|>You add.<|end|>\n<|user|>2+3<|end|>\n<|assistant|>5<|end|>\n"
    assert render(CONVO[:2], BUILTIN_TEMPLATE, add_generation_prompt=True) == (
        "<|system|>You add.<|end|>\n<|user|>2+3<|end|>\n<|assistant|>")


def test_byte_mask_marks_assistant_content_and_closing_marker_only():
    ids, target = encode_chat(CONVO, BUILTIN_TEMPLATE, ByteTokenizer(), source="t")
    text = render(CONVO, BUILTIN_TEMPLATE)
    assert ids.dtype == np.int32 and target.dtype == np.bool_ and ids.shape == target.shape == (len(text),)
    assert bytes(ids.astype(np.uint8)).decode() == text
    start = text.index("<|assistant|>") + len("<|assistant|>")
    expect = np.zeros(len(text), bool)
    expect[start:] = True  # "5<|end|>\n": the content and the closing marker, not the header
    np.testing.assert_array_equal(target, expect)


def test_multi_turn_mask_covers_each_assistant_turn():
    tok = ByteTokenizer()
    ids, target = encode_chat(MULTI, BUILTIN_TEMPLATE, tok)
    assert len(ids) == len(render(MULTI, BUILTIN_TEMPLATE).encode())
    assert target_text(tok, ids, target) == "tac<|end|>\n|DOG ü<|end|>\n"


def test_kimi_tokenizer_mask_with_special_tokens():
    tok = kimi_tokenizer()
    ids, target = encode_chat(MULTI, KIMI_TEMPLATE, tok)
    full = render(MULTI, KIMI_TEMPLATE)
    assert tok.encode(full) == ids.tolist() and len(ids) < len(full.encode())  # merges and specials applied
    assert target_text(tok, ids, target) == "tac<|im_end|>|DOG ü<|im_end|>"
    assert tok.special_tokens["<|im_end|>"] in ids[target].tolist()
    assert tok.special_tokens["<|im_middle|>"] not in ids[target].tolist()


def test_a_token_straddling_the_header_is_a_target():
    # the byte template has no special tokens: "|>!?" is one pre-token piece, and the merge ">!" joins the
    # header's last byte to the answer's first, so that token is a target (any byte inside the span counts)
    tok = kimi_tokenizer(merges=(b">!",))
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "!?"}]
    ids, target = encode_chat(convo, BUILTIN_TEMPLATE, tok)
    pieces = [tok.token_bytes(i) for i in ids.tolist()]
    first = target.tolist().index(True)
    assert pieces[first] == b">!" and b"".join(p for p, t in zip(pieces, target) if t) == b">!?<|end|>\n"


def test_prefix_mismatch_names_the_message():
    # renders the last turn differently from the same turn mid-conversation
    tmpl = "{% for m in messages %}{{ m.content }}{% if loop.last %}.{% else %}|{% endif %}{% endfor %}"
    convo = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(InputError, match=r"src:3: messages\[1\] \(assistant\)"):
        encode_chat(convo, tmpl, ByteTokenizer(), source="src:3")


@pytest.mark.parametrize("tmpl", ["{{ ''.__class__.__mro__ }}", "{{ cycler.__init__.__globals__ }}",
                                  "{{ ''.__class__ }}", "{{ messages['__class__'] }}"])
def test_template_outside_the_sandbox_is_an_input_error(tmpl):
    with pytest.raises(InputError, match="cfg.json: the chat template reached outside its sandbox"):
        render(CONVO, tmpl, source="cfg.json")


def test_syntax_error_and_raise_exception_name_the_file(tmp_path):
    with pytest.raises(InputError, match="cfg.json: chat template syntax error on its line 2"):
        render(CONVO, "ok\n{% for %}", source="cfg.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if x %}"}))
    with pytest.raises(InputError, match=r"tokenizer_config\.json: chat template syntax error"):
        load_template(str(tmp_path))
    with pytest.raises(InputError, match="data.jsonl:4: the chat template failed: no tools here"):
        render(CONVO, "{{ raise_exception('no tools here') }}", source="data.jsonl:4")


def test_tojson_and_generation_prompt_variables_follow_hf():
    out = render([{"role": "user", "content": "<a & b>"}], "{{ messages | tojson }}{{ bos_token }}|{{ eos_token }}",
                 bos_token="[BOS]")
    assert out == '[{"role": "user", "content": "<a & b>"}][BOS]|'  # no HTML escaping, unlike jinja's tojson


def test_unknown_role_and_missing_assistant():
    with pytest.raises(InputError, match=r"f:2: messages\[1\]\.role is 'robot'"):
        render([CONVO[0], {"role": "robot", "content": "x"}], BUILTIN_TEMPLATE, source="f:2")
    with pytest.raises(InputError, match=r"messages\[0\]\.content must be a string"):
        render([{"role": "user", "content": ["x"]}], BUILTIN_TEMPLATE)
    with pytest.raises(InputError, match="f:9: the conversation has no assistant message"):
        encode_chat(CONVO[:2], BUILTIN_TEMPLATE, ByteTokenizer(), source="f:9")


def test_load_template_string_list_and_jinja_file(tmp_path):
    assert load_template(None) is None and load_template(str(tmp_path)) is None
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": KIMI_TEMPLATE}))
    assert load_template(str(tmp_path)) == KIMI_TEMPLATE
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"},
                                                 {"name": "default", "template": BUILTIN_TEMPLATE}]}))
    assert load_template(str(tmp_path)) == BUILTIN_TEMPLATE
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(InputError, match="without a .*'default'.*tool_use"):
        load_template(str(tmp_path))
    cfg.write_text("{not json")
    with pytest.raises(InputError, match=r"tokenizer_config\.json: not valid JSON"):
        load_template(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("J")  # newer transformers save it beside the config; it wins
    assert load_template(str(tmp_path)) == "J"


def test_template_for_falls_back_to_builtin_for_bytes_only(tmp_path):
    assert template_for(None, ByteTokenizer()) == BUILTIN_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {}}))
    assert template_for(str(tmp_path), ByteTokenizer()) == BUILTIN_TEMPLATE
    with pytest.raises(InputError, match=r"chat data needs a chat template: .*tokenizer_config\.json has no chat_t"):
        template_for(str(tmp_path), kimi_tokenizer())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": KIMI_TEMPLATE}))
    assert template_for(str(tmp_path), kimi_tokenizer()) == KIMI_TEMPLATE


def test_read_chat_jsonl_and_sniff(tmp_path):
    good = tmp_path / "chat.jsonl"
    good.write_text(json.dumps({"messages": CONVO, "answer": "5"}) + "\n\n" + json.dumps({"messages": MULTI}) + "\n")
    assert read_chat_jsonl(str(good)) == [CONVO, MULTI] and sniff_jsonl(str(good)) == "messages"
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert sniff_jsonl(str(text)) == "text"
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": "a"}\n\n' + json.dumps({"messages": CONVO}) + "\n")
    with pytest.raises(InputError, match=r"mixed\.jsonl:3: a \"messages\" line in a \"text\" file \(line 1\)"):
        sniff_jsonl(str(mixed))
    bad = tmp_path / "bad.jsonl"
    for line, pattern in [('{"msgs": []}', r'bad\.jsonl:2: missing the field "messages"'),
                          ('{"messages": [{"role": "bot", "content": "x"}]}', r"bad\.jsonl:2: messages\[0\]\.role"),
                          ('{"messages": [{"role": "user", "content": "x"}]}', r"bad\.jsonl:2: .*no assistant"),
                          ("[1]", r"bad\.jsonl:2: each line must be a JSON object"),
                          ("{oops", r"bad\.jsonl:2: not JSON")]:
        bad.write_text(json.dumps({"messages": CONVO}) + "\n" + line + "\n")
        with pytest.raises(InputError, match=pattern):
            read_chat_jsonl(str(bad))


def _maker():
    spec = importlib.util.spec_from_file_location("make_chat_data", os.path.join(SFT, "make_chat_data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chat_data_is_deterministic_and_the_committed_files_match():
    mod = _maker()
    train, heldout = mod.generate(0)
    assert (train, heldout) == mod.generate(0) and mod.generate(1)[0] != train
    assert len(train) == 3000 and len(heldout) == 200
    for name, recs in (("chat_train.jsonl", train), ("chat_heldout.jsonl", heldout)):
        with open(os.path.join(SFT, name), encoding="utf-8") as f:
            assert f.read() == mod.to_jsonl(recs), f"{name} differs from a regeneration; rerun make_chat_data.py"


def test_chat_data_heldout_is_disjoint_and_every_record_masks_its_answer():
    train = [json.loads(s) for s in open(os.path.join(SFT, "chat_train.jsonl"), encoding="utf-8")]
    heldout = [json.loads(s) for s in open(os.path.join(SFT, "chat_heldout.jsonl"), encoding="utf-8")]
    question = {id(r): r["messages"][-2]["content"] for r in train + heldout}
    assert not {question[id(r)] for r in train} & {question[id(r)] for r in heldout}
    # the item, whatever the phrasing: a word task's answer identifies its word, an addition its ordered pair
    def items(recs):
        return {(r["task"], r["answer"] if r["task"] != "add" else tuple(re.findall(r"\d+", question[id(r)])))
                for r in recs}

    assert not items(train) & items(heldout)
    assert read_chat_jsonl(os.path.join(SFT, "chat_heldout.jsonl"))[0] == heldout[0]["messages"]
    assert sniff_jsonl(os.path.join(SFT, "chat_train.jsonl")) == "messages"
    tok = ByteTokenizer()
    for r in train + heldout:
        assert r["messages"][-1] == {"role": "assistant", "content": r["answer"]} and len(r["answer"]) <= 12
        ids, target = encode_chat(r["messages"], BUILTIN_TEMPLATE, tok)
        assert bytes(ids[target].astype(np.uint8)).decode() == r["answer"] + "<|end|>\n"
