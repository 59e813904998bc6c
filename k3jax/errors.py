"""What a user can get wrong, as one exception type: `k3` exits 2 on ``InputError`` (a flag, file, tensor or config
field, named in the message, found before any compute); anything else that escapes a command is a bug in k3jax and
ends with its traceback and exit 1.

The domain errors subclass it (``ConfigError``, ``CheckpointError``, ``TokenizerError``, ``AblationSpecError``,
``CacheError``), so a library caller may catch either. It is a ValueError, so ``except ValueError`` still works.
A comma-separated list of integers (``--layers 1,2,5``, a benchmark's ``--depths``) is read by ``int_list``, the one
reader of such flags, in one wording.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input a user can fix; the message names the flag, file, tensor or field (`k3` exits 2)."""


def int_list(text: str, flag: str = "", *, minimum: int | None = None) -> list[int]:
    """The integers of a comma-separated flag value (``"1,2,5"``; empty parts are skipped): an InputError naming
    ``flag`` and the value for a part that is not an integer, no integer at all, or one below ``minimum``."""
    where = f"{flag} {text!r}" if flag else repr(text)
    want = "comma-separated integers" + ("" if minimum is None else f" >= {minimum}")
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{where}: must be {want}") from None
    if not out or (minimum is not None and min(out) < minimum):
        raise InputError(f"{where}: must be {want}")
    return out


__all__ = ["InputError", "int_list"]
