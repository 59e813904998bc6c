"""Key paths of parameter pytrees: the one place a jax key path becomes plain names, and the one way to read or
write the node at a path of nested dicts (and lists).

    key_names((DictKey("groups"), DictKey(0), DictKey("kda"), DictKey("wq")))  -> ("groups", 0, "kda", "wq")
    path_str(...)                                                               -> "groups.0.kda.wq"
    get_path(params, ("groups", "layers", 0, "kda", "wq"))                      -> params["groups"]["layers"][0]...
    set_path(params, ("post", 0, "ffn"), new)                                   -> a copy with that node replaced

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


def get_path(tree, path):
    """``tree[path[0]][path[1]]...`` (``tree`` itself for an empty path); a missing key raises as indexing does
    (KeyError / IndexError / TypeError)."""
    for k in path:
        tree = tree[k]
    return tree


def set_path(tree: dict, path: tuple, value) -> dict:
    """A copy of nested dict ``tree`` with the node at ``path`` replaced by ``value`` (``value`` itself for an empty
    path): only the dicts along the path are copied, missing ones are created, ``tree`` is left as it was."""
    if not path:
        return value
    head, *rest = path
    return {**tree, head: set_path(tree.get(head, {}), tuple(rest), value)}


__all__ = ["get_path", "key_names", "path_str", "set_path"]
