"""Chat templates and chat data: render a conversation the way the checkpoint's template does, and mark which of
its tokens the model should learn to produce.

    template = template_for("Kimi-K3/", tok)       # the checkpoint's chat_template, or BUILTIN_TEMPLATE for bytes
    text = render(messages, template, add_generation_prompt=True)      # a prompt ending in the assistant header
    ids, target = encode_chat(messages, template, tok, source="chat.jsonl:3")   # [L] int32, [L] bool

Templates come with a download, so they run in jinja2's ``ImmutableSandboxedEnvironment`` under Hugging Face's
conventions (``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, a ``raise_exception(msg)`` global,
a ``tojson`` filter that does not escape HTML, variables ``messages``, ``add_generation_prompt``, ``bos_token`` and
``eos_token``); an attribute outside the sandbox is an error here, not HF's silent empty string. The byte-level
presets have no tokenizer_config.json and get ``BUILTIN_TEMPLATE``: Kimi's layout
(``<|im_user|>user<|im_middle|>...<|im_end|>``) with shorter markers, since every character is a token:

    <|system|>You add.<|end|>\\n<|user|>2+3<|end|>\\n<|assistant|>5<|end|>\\n

``<|end|>\\n`` closes every turn; its newline lets a byte model stop on id 10 after a one-line answer. Chat JSONL
holds one ``{"messages": [{"role": ..., "content": ...}, ...]}`` a line; other keys (e.g. ``answer``) are ignored.
"""

from __future__ import annotations

import functools
import json
import os

import jinja2
import jinja2.ext
import numpy as np
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3jax.errors import InputError

BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")
CONFIG_FILE, JINJA_FILE = "tokenizer_config.json", "chat_template.jinja"


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj, attribute):
        # jinja2 returns an Undefined that prints as "" until it is used further; a template probing `__class__`
        # is hostile or broken either way, so stop at the first touch.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's override: jinja's own tojson escapes <, >, & and ' for HTML, which would change the rendered text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _compile(template: str, source: str) -> jinja2.Template:
    try:
        return _compiled(template)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"{source}: chat template syntax error on its line {e.lineno}: {e.message}") from None


def load_template(path: str | None) -> str | None:
    """The chat template stored with a checkpoint directory, or None when it has none (or ``path`` is None).

    ``chat_template.jinja`` (newer transformers save it beside the config) wins over ``tokenizer_config.json``'s
    ``chat_template``, which is a string or HF's list form ``[{"name": "default", "template": ...}, ...]`` (the
    "default" entry is used). The template is compiled here, so a syntax error names its file.
    """
    if not path:
        return None
    jinja_path, cfg_path = os.path.join(path, JINJA_FILE), os.path.join(path, CONFIG_FILE)
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
        _compile(template, jinja_path)
        return template
    if not os.path.isfile(cfg_path):
        return None
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise InputError(f"{cfg_path}: chat_template is a list without a {{'name': 'default', 'template': str}}"
                             f" entry (names: {sorted(map(str, named))})")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise InputError(f"{cfg_path}: chat_template must be a string or a list of named templates, "
                         f"got {type(template).__name__}")
    if template is not None:
        _compile(template, cfg_path)
    return template


def template_for(path: str | None, tokenizer) -> str:
    """The checkpoint's template; else BUILTIN_TEMPLATE for the byte tokenizer; else InputError."""
    template = load_template(path)
    if template is not None:
        return template
    if tokenizer.name == "bytes":
        return BUILTIN_TEMPLATE
    raise InputError(f"chat data needs a chat template: {os.path.join(path or '.', CONFIG_FILE)} has no chat_template")


def check_messages(messages, source: str = "", *, need_assistant: bool = False) -> None:
    """Each message a dict with a string ``role`` in ROLES and a string ``content`` (other keys are passed on)."""
    if not isinstance(messages, list):
        raise InputError(f"{source}: \"messages\" must be a list of {{'role': ..., 'content': ...}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"{source}: messages[{i}] must be an object, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise InputError(f"{source}: messages[{i}].role is {m.get('role')!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise InputError(f"{source}: messages[{i}].content must be a string, got {type(m.get('content')).__name__}")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise InputError(f"{source}: the conversation has no assistant message (nothing to learn)")


def render(messages, template: str, *, add_generation_prompt: bool = False, source: str = "",
           bos_token: str = "", eos_token: str = "") -> str:
    """The template's text for ``messages``; any template failure is an InputError naming ``source``."""
    check_messages(messages, source)
    tmpl = _compile(template, source)
    try:
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                           eos_token=eos_token)
    except SecurityError as e:
        raise InputError(f"{source}: the chat template reached outside its sandbox: {e}") from None
    except jinja2.TemplateError as e:  # raise_exception(...), undefined names, runtime errors jinja reports
        raise InputError(f"{source}: the chat template failed: {e}") from None
    except (TypeError, ValueError, LookupError, ArithmeticError) as e:  # e.g. 1 + 'a' inside the template
        raise InputError(f"{source}: the chat template failed: {type(e).__name__}: {e}") from None


def encode_chat(messages, template: str, tokenizer, *, source: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the rendered conversation and which of them are training targets.

    Rule, template-agnostic: for each assistant message i, P = render(messages[:i], add_generation_prompt=True)
    and Q = render(messages[:i + 1]). P must be a prefix of Q, and Q a prefix of the whole rendering F; the text
    F[len(P):len(Q)] is what the model produces for that turn (its content and the template's closing marker, not
    the assistant header). A template that renders a prefix differently from the whole (e.g. one that drops earlier
    turns' reasoning) is an InputError naming the message. F is tokenized once; a token is a target when any of
    its bytes lies in such a span (with special-token markers the spans fall on token boundaries).

    Returns:
      ids: [L] int32 token ids of F.
      target: [L] bool, True where the model should learn to produce the token.
    """
    check_messages(messages, source, need_assistant=True)
    full = render(messages, template, source=source)
    full_bytes = full.encode("utf-8")
    target_bytes = np.zeros(len(full_bytes), np.bool_)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:i], template, add_generation_prompt=True, source=source)
        done = render(messages[: i + 1], template, source=source)
        if not done.startswith(prompt) or not full.startswith(done):
            what = "the generation prompt before it" if not done.startswith(prompt) else "the rendering up to it"
            raise InputError(f"{source}: messages[{i}] (assistant): {what} is not a prefix of the template's "
                             "rendering of the whole conversation, so its tokens cannot be marked")
        target_bytes[len(prompt.encode("utf-8")): len(done.encode("utf-8"))] = True
    ids = np.asarray(tokenizer.encode(full), np.int32)
    if tokenizer.name == "bytes":
        return ids, target_bytes  # one token per byte
    lengths = np.array([len(tokenizer.token_bytes(int(t))) for t in ids], np.int64)
    if lengths.sum() != len(full_bytes) or (lengths == 0).any():
        raise RuntimeError(f"{source}: the tokens do not spell the rendered text byte for byte")
    ends = np.cumsum(lengths)
    covered = np.concatenate([[0], np.cumsum(target_bytes)])
    return ids, covered[ends] - covered[ends - lengths] > 0


def jsonl_records(path: str):
    """(line number, parsed object) for each non-blank line, read one line at a time (a corpus larger than memory
    streams); not-a-file, not UTF-8, not JSON → InputError. Lines end at "\n" only: JSON strings may hold U+2028
    and friends, which ``str.splitlines`` would cut at."""
    if not os.path.isfile(path):
        raise InputError(f"no such file {path!r}")
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{path}: not UTF-8 ({e})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise InputError(f"{path}:{n}: each line must be a JSON object, got {type(rec).__name__}")
            yield n, rec


def read_chat_jsonl(path: str) -> list[list[dict]]:
    """The conversations of a ``{"messages": [...]}`` JSONL file, each checked (roles, contents, an assistant turn)."""
    out = []
    for n, rec in jsonl_records(path):
        if "messages" not in rec:
            raise InputError(f"{path}:{n}: missing the field \"messages\"")
        check_messages(rec["messages"], f"{path}:{n}", need_assistant=True)
        out.append(rec["messages"])
    if not out:
        raise InputError(f"{path}: no conversations")
    return out


def sniff_jsonl(path: str) -> str:
    """"text" for ``{"text": ...}`` lines, "messages" for chat lines; one kind per file, the first line decides."""
    kind = first = None
    for n, rec in jsonl_records(path):
        has = [k for k in ("text", "messages") if k in rec]
        if len(has) != 1:
            raise InputError(f"{path}:{n}: a line needs exactly one of the fields \"text\" or \"messages\", "
                             f"has {has or list(rec)[:5]}")
        if kind is None:
            kind, first = has[0], n
        elif has[0] != kind:
            raise InputError(f"{path}:{n}: a \"{has[0]}\" line in a \"{kind}\" file (line {first}); "
                             "put text and chat data in separate files")
    if kind is None:
        raise InputError(f"{path}: no records")
    return kind


__all__ = ["BUILTIN_TEMPLATE", "ROLES", "check_messages", "encode_chat", "jsonl_records", "load_template",
           "read_chat_jsonl",
           "render", "sniff_jsonl", "template_for"]
