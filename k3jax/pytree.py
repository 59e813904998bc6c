"""Key paths of parameter pytrees: the one place a jax key path becomes plain names.

    key_names((DictKey("groups"), DictKey(0), DictKey("kda"), DictKey("wq")))  -> ("groups", 0, "kda", "wq")
    path_str(...)                                                               -> "groups.0.kda.wq"

Works for the key entries jax and flax produce (``DictKey``, ``SequenceKey``, ``GetAttrKey``, ``FlattenedIndexKey``)
and for tuples that are already plain names.
"""

from __future__ import annotations


def _name(k):
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def key_names(path) -> tuple:
    """A jax key path (or a tuple of plain str / int names) as a tuple of plain names."""
    return tuple(_name(k) for k in path)


def path_str(path, sep: str = ".") -> str:
    return sep.join(str(k) for k in key_names(path))


__all__ = ["key_names", "path_str"]
