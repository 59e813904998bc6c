"""``ConfigError`` and the one field check every settings class of this package validates with (the architecture,
the run settings, LoRA's): a malformed value is an error naming its field and the value it got."""

from __future__ import annotations

from k3jax.errors import InputError


class ConfigError(InputError):
    """A malformed or contradictory config; the message names the field."""


def need(c, cond: bool, fld: str, msg: str) -> None:
    """Raise ``ConfigError`` naming ``c``'s field ``fld``, its value and ``msg`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"config field {fld!r}: {msg} (got {getattr(c, fld, None)!r})")


def positive_int(v) -> bool:
    """``v`` is an ``int`` (not a ``bool``) above zero."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


__all__ = ["ConfigError", "need", "positive_int"]
