"""The residual stream between decoder layers as a small carry (docs/model.md §1.3 / §3.2): what a layer reads its
sublayers' inputs from and adds their outputs to. ``DecoderLayer.__call__`` (k3jax/model/decoder.py) runs one layer
on any of the three forms; the network (k3jax/model/network.py) only loops or scans the layers over it.

    Stream(h)              no AttnRes (Kimi-Linear): the pre-norm residual h [B, T, D]
    Blocks(part, blocks)   AttnRes, unrolled stack: the running block sum ``part`` and the committed block sums
                           (a tuple; layer l with l mod S = 0 commits ``part`` before its token mixer adds to it)
    Buffer(part, buf)      AttnRes, scanned stack (traced l): the committed block sums in a fixed buffer
                           [NB, B, T, D], of which the first ceil(l / S) slots are filled when layer l starts

Each answers the same three questions of layer l: ``enter`` (the token mixer's input, the carry after the layer's
commit and a mark of where the layer stands), ``add`` (a sublayer's output into the stream) and ``ffn_input`` (the
FFN's input, given the mark: the buffer form reads the blocks ``enter`` found plus the commit). Sums stay in the
stream's at-least-fp32 dtype; ``pin(x, batch_dim)`` constrains a stream array to the token sharding (``_walk`` in
network.py). The list and the buffer form mix the same sources (``ops.attn_res``: ``attn_res`` vs
``attn_res_masked``). With ``with_ms`` the two readers return (x, its mean square [..., 1] or None), the mean square
from the mix's Gram matrix where x is an AttnRes mix (``ops.attn_res``), None where x is a stream value (the norm then
takes its own).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def unpinned(x, batch_dim: int = 0):
    """The ``pin`` of a call without a token sharding: x itself."""
    return x


class Stream(NamedTuple):
    """The plain pre-norm residual: both sublayers read h and add to it."""

    h: jax.Array

    def enter(self, query, l, size, eps: float, pin=unpinned, with_ms: bool = False):
        return ((self.h, None) if with_ms else self.h), self, None

    def add(self, y, pin=unpinned) -> Stream:
        return Stream(pin(self.h + y.astype(self.h.dtype)))

    def ffn_input(self, query, mark, eps: float, with_ms: bool = False):
        return (self.h, None) if with_ms else self.h


class Blocks(NamedTuple):
    """AttnRes with the committed block sums as a tuple (the unrolled stack: l is a Python int). ``part`` is None
    only inside a layer, between its commit and its token mixer's output."""

    part: jax.Array | None
    blocks: tuple = ()

    def enter(self, query, l: int, size: int, eps: float, pin=unpinned, with_ms: bool = False):
        if not self.blocks:
            h = (self.part, None) if with_ms else self.part
        else:
            h = query([*self.blocks, self.part], eps, with_ms)
        if l % size == 0:
            return h, Blocks(None, (*self.blocks, self.part)), None
        return h, self, None

    def add(self, y, pin=unpinned) -> Blocks:
        if self.part is None:                             # the first output after a commit starts the new sum
            return Blocks(pin(y.astype(self.blocks[-1].dtype)), self.blocks)
        return Blocks(pin(self.part + y.astype(self.part.dtype)), self.blocks)

    def ffn_input(self, query, mark, eps: float, with_ms: bool = False):
        return query([*self.blocks, self.part], eps, with_ms)

    def buffered(self, n: int, pin=unpinned) -> Buffer:
        """The buffer form with room for ``n`` committed blocks (the commits of the whole stack)."""
        buf = jnp.zeros((n, *self.part.shape), self.part.dtype)
        for i, b in enumerate(self.blocks):
            buf = buf.at[i].set(b)
        return Buffer(self.part, pin(buf, batch_dim=1))


class Buffer(NamedTuple):
    """AttnRes with the committed block sums in a buffer [NB, B, T, D] (the scanned stack: l is traced, so a commit
    is a select)."""

    part: jax.Array
    buf: jax.Array

    def enter(self, query, l, size: int, eps: float, pin=unpinned, with_ms: bool = False):
        nb = (l + size - 1) // size                       # blocks committed before layer l
        h = query.masked(self.buf, nb, self.part, eps, with_ms)
        commit = l % size == 0
        # a commit writes slot nb; otherwise slot nb gets its own value back: one slot of traffic, where a select
        # between the updated and the old buffer read and wrote all NB of them at every layer (the frozen-experts
        # v5p-512 plan's ~3.2 TB of f32 [8, B, T, D] selects, experiments/LOG.md)
        slot = jax.lax.dynamic_index_in_dim(self.buf, nb, 0, keepdims=False)
        buf = pin(jax.lax.dynamic_update_index_in_dim(self.buf, jnp.where(commit, self.part, slot), nb, 0),
                  batch_dim=1)
        part = jnp.where(commit, jnp.zeros_like(self.part), self.part)      # 0 + y == y exactly
        return h, Buffer(part, buf), (nb, commit)

    def add(self, y, pin=unpinned) -> Buffer:
        return Buffer(pin(self.part + y.astype(self.part.dtype)), self.buf)

    def ffn_input(self, query, mark, eps: float, with_ms: bool = False):
        nb, commit = mark                                 # layer l's commit included
        return query.masked(self.buf, nb + commit, self.part, eps, with_ms)

    def listed(self, n: int) -> Blocks:
        """The list form of the first ``n`` committed blocks."""
        return Blocks(self.part, tuple(self.buf[i] for i in range(n)))


__all__ = ["Blocks", "Buffer", "Stream", "unpinned"]
