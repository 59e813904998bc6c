"""Where each decoder layer lives in the parameter tree: the stacked layout (docs/model.md §1.3).

The layers of the repeating group are created stacked — one ``nnx.vmap`` over the group, every leaf with a leading
``layers`` logical axis — and the irregular layers stay outside, unstacked:

    state = {"embed", "pre": {i: layer}, "groups": {"layers": {j: layer [G, ...]}}, "post": {i: layer},
             "final_norm", "out_res", "lm_head"}

The group period p is the MLA spacing (K3: [KDA, KDA, KDA, MLA]); the stack starts at the first group boundary
after the dense layers and runs while the groups repeat. Kimi K3 (93 layers): pre = layers 0-3 (layer 0 has the dense
FFN), 22 stacked groups = layers 4-91, post = layer 92. k3-mini (9 layers): pre 0-3, one group 4-7, post 8.

Why a 4-layer unit and not 12: AttnRes commits a block every 12 layers (docs/model.md §3.2), which a 12-layer group
would align with — but layer 0's dense FFN makes layers 0-11 irregular and 93 = 7·12 + 9 leaves 9 more outside, so a
12-layer unit stacks 72 layers and leaves 21 unstacked, where the 4-layer unit stacks 88 and leaves 5. The block
boundary is a property of the layer index, not of the parameters: the forward (and a scan over groups) keeps a
fixed-size buffer of committed block sums and commits where ``l % block_size == 0``.

``layer_view(params, cfg, l)`` gives layer l's parameter dict (stacked leaves sliced at its group); ``unstack`` the
whole per-layer view ``{"layers": [layer dict, ...], ...}`` that the float64 reference and the checkpoint name map
address (``("layers", l, ...)`` paths).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from k3jax.config import K3Config
from k3jax.pytree import get_path, set_path


class Layout(NamedTuple):
    pre: tuple[int, ...]  # layer indices kept unstacked before the stack
    start: int  # first stacked layer
    period: int  # layers per group
    groups: int  # number of stacked groups G (0: no stack)
    post: tuple[int, ...]  # layer indices kept unstacked after the stack

    def locate(self, l: int) -> tuple[tuple, int | None]:
        """(path prefix of layer l's dict in the state, index along the stacked axis or None)."""
        if l in self.pre:
            return ("pre", self.pre.index(l)), None
        if l in self.post:
            return ("post", self.post.index(l)), None
        g, j = divmod(l - self.start, self.period)
        return ("groups", "layers", j), g

    def stacked_layers(self, j: int) -> tuple[int, ...]:
        """The layer indices stacked at group position j, in stack order."""
        return tuple(self.start + g * self.period + j for g in range(self.groups))

    def slots(self) -> list[tuple[tuple, tuple[int, ...], bool]]:
        """Every layer dict of the state: (path prefix, layer indices, stacked?)."""
        out = [(("pre", i), (l,), False) for i, l in enumerate(self.pre)]
        if self.groups:
            out += [(("groups", "layers", j), self.stacked_layers(j), True) for j in range(self.period)]
        return out + [(("post", i), (l,), False) for i, l in enumerate(self.post)]


def layer_kind(cfg: K3Config, l: int) -> tuple[str, str]:
    """(token mixer, FFN) of layer l: ("kda" | "mla", "mlp" | "moe")."""
    return ("mla" if cfg.is_mla(l) else "kda", "moe" if cfg.is_moe(l) else "mlp")


@functools.lru_cache(maxsize=64)
def layout(cfg: K3Config) -> Layout:
    L = cfg.num_layers
    mla = cfg.mla_layers
    p = mla[0] + 1 if mla else 1
    start = -(-cfg.first_k_dense_replace // p) * p
    pattern = [layer_kind(cfg, l) for l in range(start, min(start + p, L))]
    G = 0
    while start + (G + 1) * p <= L and all(layer_kind(cfg, start + G * p + j) == pattern[j] for j in range(p)):
        G += 1
    if G == 0:
        return Layout(tuple(range(L)), L, p, 0, ())
    end = start + G * p
    return Layout(tuple(range(start)), start, p, G, tuple(range(end, L)))


def layer_view(params, cfg: K3Config, l: int) -> dict:
    """Layer l's parameter dict (stacked leaves sliced at its group index)."""
    prefix, g = layout(cfg).locate(l)
    d = get_path(params, prefix)
    return d if g is None else jax.tree.map(lambda x: _row(x, g), d)


def _row(x, g: int):
    if isinstance(x, jax.ShapeDtypeStruct):  # abstract trees (``abstract_params``) slice to one layer's shape
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[g]


def unstack(params, cfg: K3Config) -> dict:
    """The per-layer view ``{"layers": [layer dict per l], <model-level leaves>}`` of a state dict."""
    out = {k: v for k, v in params.items() if k not in ("pre", "groups", "post")}
    out["layers"] = [layer_view(params, cfg, l) for l in range(cfg.num_layers)]
    return out


def restack(view: dict, cfg: K3Config) -> dict:
    """Inverse of ``unstack``: a per-layer view ``{"layers": [...], ...}`` → the state dict (stacks the groups)."""
    import jax.numpy as jnp

    lay = layout(cfg)
    layers = view["layers"]
    out = {k: v for k, v in view.items() if k != "layers"}
    if lay.pre:  # an empty section has no leaves, so the state has no key for it
        out["pre"] = {i: layers[l] for i, l in enumerate(lay.pre)}
    if lay.groups:
        out["groups"] = {"layers": {j: jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[l] for l in
                                                                                  lay.stacked_layers(j)])
                                    for j in range(lay.period)}}
    if lay.post:
        out["post"] = {i: layers[l] for i, l in enumerate(lay.post)}
    return out


def gather_layers(params, cfg: K3Config, layers, fn):
    """``stack([fn(layer_view(params, cfg, l)) for l in layers])``: one value per listed layer, in that order."""
    import jax.numpy as jnp

    return jnp.stack([fn(layer_view(params, cfg, l)) for l in layers])


def map_layers(params, cfg: K3Config, layers, fn, values) -> dict:
    """params with layer l's dict replaced by ``fn(layer dict, values[i])`` for ``l = layers[i]``.

    ``values`` is an array [len(layers), ...]. A stacked slot must be listed whole (its layers are alike, so a
    selection by kind always is); it is updated in one ``jax.vmap`` of ``fn``."""
    import jax.numpy as jnp

    row = {l: i for i, l in enumerate(layers)}
    out = dict(params)
    for prefix, ls, stacked in layout(cfg).slots():
        hit = [l in row for l in ls]
        if not any(hit):
            continue
        if not all(hit):
            raise ValueError(f"map_layers: layers {ls} are stacked together; list all or none of them")
        d = get_path(params, prefix)
        new = (jax.vmap(fn)(d, jnp.stack([values[row[l]] for l in ls])) if stacked else fn(d, values[row[ls[0]]]))
        out = set_path(out, prefix, new)
    return out


def leaf_location(path: tuple, cfg: K3Config) -> tuple[tuple, int | None]:
    """A per-layer-view path ``("layers", l, *rest)`` (or a model-level path) → (state path, stack index)."""
    if path and path[0] == "layers":
        prefix, g = layout(cfg).locate(path[1])
        return (*prefix, *path[2:]), g
    return tuple(path), None


__all__ = ["Layout", "gather_layers", "layer_kind", "layer_view", "layout", "leaf_location", "map_layers", "restack",
           "unstack"]
