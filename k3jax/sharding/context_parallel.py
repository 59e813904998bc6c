"""Context parallelism: one sequence split over devices, exactly (``--mesh context=4``).

    cp = ContextParallel(mesh, "fsdp", batch=2)                   # rows over the batch axes, T over the seq axes
    logits = forward(params, tokens, cfg, dispatch=cp)            # experts whole on every device, rows local
    ep = ExpertParallel(mesh, "ep", context=cp)                   # with it: the MoE's rows follow the same split
    logits = forward(params, tokens, cfg, dispatch=ep)

Which axes split what. The rules map ``seq`` to the ``context`` mesh axis (every column but ``single``). The batch
takes the leading token axes (``data``, ``fsdp``, ``expert``) whose sizes divide it; the token axes it cannot use
join the sequence ahead of ``context`` (``seq_axes``): one 1M-token sequence on fsdp 8 × context 8 × expert 8 is
split 512 ways, T / 512 tokens per chip, and the MoE's token rows [B·T] are split the same way (``ExpertParallel``
reads ``row_axes``). Nothing is replicated that the sequence could split. Shard p of the ``n`` sequence shards holds
tokens [p L, (p + 1) L), L = T / n; T must be a multiple of n, and L at least the KDA conv's Wc - 1 = 3 tokens
(``check``). The model is written over global arrays; ``constrain_tokens`` pins its residual stream to this split at
every layer boundary, so every per-token op (projections, norms, AttnRes, the FFNs) runs on its own shard. Only the
token mixers look across shards, each in one ``shard_map``:

KDA (``kda``). The gated delta rule's state update is affine in the incoming state: the state after token t of a
shard is S_t = A_t S_in + S⁰_t, where A_t (K × K per head) is the product of the shard's transitions so far and S⁰_t
the state of a zero start. Each shard runs the ordinary chunked core ONCE on augmented values [v | 0_K] from the
initial state [0 | I_K]: its columns evolve independently, so the state's extra K columns are A_t and the output's
extra K columns are s q_tᵀ A_t. The shard's span map (M, b) = (A_L, S⁰_L) is combined over the shards by an
exclusive scan (``combine``: "ppermute", a log-step Hillis–Steele scan of affine maps over ``ppermute``, or
"gather", all-gather and chain), and the output is corrected with the true incoming state:
o_t = o⁰_t + (s q_tᵀ A_t) S_in — exact, no second pass. The conv takes its Wc - 1 = 3 pre-conv inputs from the
left neighbour (``ppermute``). Packed documents (``segment_ids``): a shard that starts a new document starts from
a zero state and an empty conv window (its identity columns and tail are zeroed); inside the shard the core's own
document masks restart it. Gradients: autodiff through all of it (ppermute's transpose is the reverse ppermute);
the core's memory is the chunked core's (one state per group of chunks) at V + K columns instead of V, and the scan
adds log2(n) [B, N, K, K + V] fp32 maps.

MLA (``attention``, ``latent_flash``, ``latent_attention``). The compressed latent (c_kv after its norm and the
shared key slice: kv_lora + rope values per token, 576 at full K3) is all-gathered along the sequence; the
up-projected keys and values never cross the shards. ``attention`` (XLA): each shard up-projects the keys and values
of the whole sequence and attends from its own queries at their global positions (``causal_attention(q_offset=...)``)
with a fixed trip count over all T keys, so its compiled FLOPs are the same on every shard (T L per head, 1/n of the
one-device program's T², which also computes its masked blocks). ``latent_flash``: a flash kernel (the Pallas one
in pallas_kernels/mla, passed in) runs per shard over the gathered latent, up-projecting each key block itself and
skipping the blocks above the diagonal; the max logit for QK-Clip is a pmax. The cached path reads the gathered
latent cache with the queries' global positions: through ``ops.latent_attention`` (``latent_attention``) or the
flash kernel with per-row offsets (``latent_flash_cached``, split like ``latent_flash``).

Load balance (``latent_flash(balance=True)``, the default). With block skipping, a contiguous split is skewed: shard
p does (p + 1/2) L² (query, key) pairs, the last one 2n - 1 times the first (less at block granularity). KDA's scan
needs contiguous spans, so the balancing lives around the attention only. Every shard keeps the first half of its
queries and swaps the second half with its mirror shard n-1-p (one ``ppermute`` of q there, one of o back: the swap
is its own inverse, and autodiff's transpose is the same swap for dO and dq). Shard p then attends for half-blocks
2p and 2n-1-2p of the 2n: (2p + 1/2 + 2n-1-2p + 1/2) (L/2)² = n L²/2 each, exactly the mean.
Counted by ``causal_block_pairs`` (the flash kernel's (query block, key block) pairs per shard, no documents),
L = 4096 tokens per shard:

    blocks (bq, bk)   n   contiguous: max / mean   max / min     mirror: max / mean
    (512, 256) TPU    2          1.47                2.78               1.000
                      4          1.73                6.33               1.000
                      8          1.86               13.4                1.000
    (128, 64) GPU     2          1.49                2.94               1.000
                      8          1.87               14.6                1.000

The zigzag split (2n half-blocks, shard p takes p and 2n-1-p) is balanced as well, but moves the queries of 2n - 2
of the 2n half-blocks (0.75 L per shard at n = 4, 0.875 L at n = 8) where the mirror moves L/2 (none for the middle
shard of an odd n); at n = 2 they are the same split. Cost of the swap per shard and MLA layer, K3 in bf16: L/2 ·
N (Hn + Hr + V) · 2 B = 30 KiB per token of L forward (q out, o back), the same again backward (dO, dq); fp32 q / o
double it. Against it, the critical shard saves (n - 1)/2 · L² (query, key) pairs of ~1150 FLOP per head at bq =
512 (the scores and values, 640, plus the key block's up-projection shared by bq queries, 2 R (Hn + V) / bq): (n - 1)
L · 1.8 FLOP per byte moved forward. That beats a link's FLOP-per-byte ratio (H100 989 TFLOP/s over NVLink's
450 GB/s per direction: ~2200; TPU v5p 459 TFLOP/s over one ~200 GB/s ICI link: ~2300) from L ≈ 1300 tokens at
n = 2 and L ≈ 180 at n = 8, and sequences are split for their length. (Moving q is needed in any balanced scheme:
all keys are on every shard already, and a query's work can only be moved with it or its x.) A shard of one token
stays contiguous. All of this is counted, not timed (no multi-chip run yet); the mirror partner can be several
ICI hops away on a ring (p = n/4: about n/2), which the count does not see.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.errors import InputError
from k3jax.ops.attention import causal_attention
from k3jax.ops.grouped_matmul import varying_zeros
from k3jax.ops.kda import causal_conv_silu, l2norm
from k3jax.ops.norms import acc_dtype
from k3jax.ops.segments import runs
from k3jax.sharding.expert_parallel import ExpertParallel
from k3jax.sharding.mesh import axis_sizes
from k3jax.sharding.rules import mesh_axes_of

COMBINES = ("ppermute", "gather")


def _spec_axes(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def split_axes(rules, mesh, batch: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(batch axes, sequence axes) of a batch of ``batch`` rows: the batch takes the leading token axes whose sizes
    divide it, the rest of the token axes and the ``seq`` axes (context) split the sequence."""
    sizes = axis_sizes(mesh)
    token = mesh_axes_of("batch", rules, mesh)
    taken, k = [], 1
    for a in token:
        if batch % (k * sizes[a]):
            break
        taken.append(a)
        k *= sizes[a]
    return tuple(taken), (*token[len(taken):], *mesh_axes_of("seq", rules, mesh))


def causal_block_pairs(T: int, n: int, block_q: int, block_k: int, *, balance: bool = True) -> list[int]:
    """The (query block, key block) pairs at or below the causal diagonal that each of the ``n`` shards visits in
    ``latent_flash`` over a T-token row without documents (the flash kernel's block skipping: query blocks start at
    each query piece's first token, key blocks at token 0); ``balance``: the mirror split (module docstring)."""
    L = T // n
    h0 = L // 2 if balance and L >= 2 else L

    def pairs(a: int, m: int) -> int:                       # queries [a, a + m)
        return sum(min(a + min(i * block_q + block_q, m) - 1, T - 1) // block_k + 1
                   for i in range(-(-m // block_q)))

    return [pairs(p * L, h0) + (pairs((n - 1 - p) * L + h0, L - h0) if h0 < L else 0) for p in range(n)]


class ContextParallel:
    """The sequence split of one batch size on ``mesh`` (module docstring); passed to the model as ``dispatch``
    (or inside an ``ExpertParallel``: ``ExpertParallel(..., context=cp)``)."""

    def __init__(self, mesh: jax.sharding.Mesh, rules="fsdp", *, batch: int, combine: str = "ppermute",
                 min_shard: int = 3, **experts):
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
        if not mesh_axes_of("seq", rules, mesh):
            raise InputError(f"context parallelism needs a mesh axis the rules map 'seq' to (context > 1); mesh "
                             f"{dict(axis_sizes(mesh))}, rules {rules if isinstance(rules, str) else '<custom>'}")
        self.mesh, self.combine, self.batch, self.min_shard = mesh, combine, batch, min_shard
        self.batch_axes, self.seq_axes = split_axes(rules, mesh, batch)
        sizes = axis_sizes(mesh)
        self.n = math.prod(sizes[a] for a in self.seq_axes)
        self.head_axes = mesh_axes_of("heads", rules, mesh)
        self.row_axes = (*self.batch_axes, *self.seq_axes)   # the flattened [B·T] rows (row-major) split over these
        # The MoE on each shard's own token rows: an ExpertParallel over this split (with the experts whole on every
        # device when the rules do not shard them). Left to XLA, the MoE's sort by expert over all rows made every
        # device route and run the whole sequence's experts (k3-mini, T = 1024 on context = 8: the same 7.5 GFLOP
        # per device as one device; experiments/LOG.md).
        self._experts = ExpertParallel(mesh, rules, context=self, **experts)   # experts: its settings (capacity, …)

    @property
    def context(self):
        return self

    def __call__(self, *args, **kw):
        """The MoE layer's experts_fn (``ExpertParallel.__call__`` over this split)."""
        return self._experts(*args, **kw)

    def replicate(self, w):
        return self._experts.replicate(w)

    def check(self, T: int, what: str = "sequence length") -> None:
        """InputError unless a sequence of T tokens splits into ``n`` shards of at least ``min_shard`` tokens."""
        if T % self.n or T // self.n < self.min_shard:
            raise InputError(f"{what} {T}: context parallelism splits it over mesh axes {self.seq_axes} ({self.n} "
                             f"shards); it must be a multiple of {self.n} with at least {self.min_shard} tokens per "
                             f"shard (the KDA conv window), i.e. one of {self.n * self.min_shard}, "
                             f"{self.n * (self.min_shard + 1)}, …")

    def sharding(self, ndim: int, batch_dim: int = 0, seq: bool = True) -> NamedSharding:
        """[..., B, T, ...] token arrays: B over the batch axes and (``seq``) T over the sequence axes."""
        spec = [None] * ndim
        spec[batch_dim] = _spec_axes(self.batch_axes)
        if seq:
            spec[batch_dim + 1] = _spec_axes(self.seq_axes)
        return NamedSharding(self.mesh, P(*spec))

    def constrain_tokens(self, x, batch_dim: int = 0):
        """``x`` [..., B, T, ...] pinned to the split (batch over the batch axes, T over the sequence axes)."""
        if x.ndim < batch_dim + 2 or x.shape[batch_dim + 1] % self.n:
            return x
        return lax.with_sharding_constraint(x, self.sharding(x.ndim, batch_dim))

    def gather_seq(self, x):
        """[B, T, ...] with the whole sequence on every device of a sequence group (an all-gather)."""
        return lax.with_sharding_constraint(x, self.sharding(x.ndim, 0, seq=False))

    # ------------------------------------------------------------------------------------------------- helpers
    def _specs(self):
        b, s, h = _spec_axes(self.batch_axes), _spec_axes(self.seq_axes), _spec_axes(self.head_axes)
        return b, s, h

    def _shift(self, x, d: int = 1):
        """Shard p receives shard p - d's ``x`` (shards p < d receive zeros)."""
        return lax.ppermute(x, self.seq_axes, [(i, i + d) for i in range(self.n - d)])

    def _index(self):
        return lax.axis_index(self.seq_axes)

    def _total(self, x):
        return lax.psum(x, self.seq_axes)

    # --------------------------------------------------------------------------------------------------- KDA
    def kda(self, core, us, ws, g, beta, *, heads: int, tails=None, state=None, lengths=None, segment_ids=None):
        """KDA's sequence part across the shards: the three causal convs + SiLU, l2norm of q and k, and the core.

        core(q, k, v, g, beta, initial_state=, segment_ids=) → (o, final state): the chunked or recurrent core run
        on one shard. us: the pre-conv (u_q, u_k, u_v) [B, T, N·K] (head-major channels); ws: their conv
        weights [N·K, Wc]; g [B, T, N, K], beta [B, T, N] (padding already neutral: g = 0, beta = 0); tails: None
        or the cached (q, k, v) conv tails [B, Wc-1, N·K]; state: None or the cached [B, N, K, V]; lengths: None or
        [B] real tokens per row (the new tails end at each row's last one); segment_ids [B, T] or None.
        Returns (o [B, T, N, V] acc, the state after the last token [B, N, K, V], the new (q, k, v) tails)."""
        B, T = g.shape[:2]
        self.check(T)
        N, K = heads, g.shape[-1]
        Wc = ws[0].shape[1]
        V = us[2].shape[-1] // N
        ct = acc_dtype(us[0].dtype)
        b, s, h = self._specs()
        if tails is None:
            tails = tuple(jnp.zeros((B, Wc - 1, u.shape[-1]), ct) for u in us)
        if state is None:
            state = jnp.zeros((B, N, K, V), ct)
        lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
        docs = segment_ids is not None
        L = T // self.n

        def local(us, ws, tails, g, beta, state, lengths, seg):
            p = self._index()
            B, N = g.shape[0], g.shape[2]                     # this shard's rows and heads (heads split by tensor)
            first = p == 0
            # packed documents: does this shard's first token continue the previous shard's last token's document?
            cont = jnp.where(first, True, seg[:, 0] == self._shift(seg[:, -1])) if docs else jnp.ones((B,), bool)
            kept = cont.astype(ct)[:, None, None]
            outs = []
            for u, w, tail in zip(us, ws, tails, strict=True):
                tail_in = jnp.where(first, tail.astype(ct), self._shift(u[:, -(Wc - 1):].astype(ct))) * kept
                y, _ = causal_conv_silu(u, w, tail_in, None, None if not docs else runs(seg))
                outs.append(y)
            q = l2norm(outs[0].reshape(B, L, N, K))
            k = l2norm(outs[1].reshape(B, L, N, K))
            v = outs[2].reshape(B, L, N, V)
            # the augmented run: values [v | 0_K] from the state [0 | I_K] (zeroed where a document starts here)
            eye = jnp.broadcast_to(jnp.eye(K, dtype=ct), (B, N, K, K)) * kept[..., None]
            v_aug = jnp.concatenate([v, jnp.zeros((B, L, N, K), v.dtype)], axis=-1)
            init = jnp.concatenate([jnp.zeros((B, N, K, V), ct), eye], axis=-1)
            init = init + varying_zeros((), ct, q, k)       # a scan carry: as varying over the mesh as its inputs
            o_aug, F = core(q, k, v_aug, g, beta, initial_state=init, segment_ids=seg if docs else None)
            o0, oq = o_aug[..., :V].astype(ct), o_aug[..., V:].astype(ct)
            M, b_end = F[..., V:], F[..., :V]
            s_in, s_last = self._combine(M, b_end, state.astype(ct), p)
            o = o0 + jnp.einsum("blnk,bnkv->blnv", oq, s_in)
            new_tails = tuple(self._tail(u, tail, lengths, p, L, Wc) for u, tail in zip(us, tails, strict=True))
            return o, s_last, new_tails

        u_spec, w_spec, t_spec = P(b, s, h), P(h, None), P(b, None, h)
        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=((u_spec,) * 3, (w_spec,) * 3, (t_spec,) * 3, P(b, s, h, None), P(b, s, h),
                                     P(b, h, None, None), P(b), P(b, s)),
                           out_specs=(P(b, s, h, None), P(b, h, None, None), (t_spec,) * 3))
        return fn(tuple(us), tuple(ws), tuple(tails), g, beta, state, lengths, seg)

    def _combine(self, M, b_end, s0, p):
        """Exclusive scan of the shards' affine span maps S ↦ M S + b: (the state entering shard p, the state after
        the last shard, the same on every shard). The start state s0 is folded into shard 0's map."""
        first = p == 0
        b_end = jnp.where(first, jnp.einsum("bnij,bnjv->bniv", M, s0) + b_end, b_end)
        if self.combine == "gather":
            Ms, bs = lax.all_gather(M, self.seq_axes), lax.all_gather(b_end, self.seq_axes)
            ends, S = [], None
            for q in range(self.n):                     # shard 0's map already includes s0
                S = bs[q] if S is None else jnp.einsum("bnij,bnjv->bniv", Ms[q], S) + bs[q]
                ends.append(S)
            ends = jnp.stack(ends)
            s_in = jnp.where(first, s0, ends[jnp.maximum(p - 1, 0)])
            return s_in, self._total(jnp.where(p == self.n - 1, ends[-1], 0.0))
        Mc, bc, d = M, b_end, 1
        while d < self.n:                               # Hillis–Steele: after the step, [p - 2d + 1, p] composed
            Mr, br = self._shift(Mc, d), self._shift(bc, d)
            has = (p >= d)
            Mc, bc = (jnp.where(has, jnp.einsum("bnij,bnjk->bnik", Mc, Mr), Mc),
                      jnp.where(has, jnp.einsum("bnij,bnjv->bniv", Mc, br) + bc, bc))
            d *= 2
        s_in = jnp.where(first, s0, self._shift(bc))      # bc: the state after shard p
        return s_in, self._total(jnp.where(p == self.n - 1, bc, 0.0))

    def _tail(self, u, tail, lengths, p, L, Wc):
        """The Wc - 1 pre-conv inputs before each row's end (token lengths[b]) in the global stream tail ++ u: row
        r of that stream is cached-tail row r (r < Wc - 1) or token r - (Wc - 1), held by one shard."""
        ct = tail.dtype
        r = lengths[:, None] + jnp.arange(Wc - 1, dtype=jnp.int32)[None, :]          # [B, Wc-1] stream rows
        t = r - (Wc - 1) - p * L                                                     # local token index
        mine = (t >= 0) & (t < L)
        got = jnp.take_along_axis(u, jnp.clip(t, 0, L - 1)[:, :, None], axis=1).astype(ct)
        from_tail = jnp.take_along_axis(tail, jnp.clip(r, 0, Wc - 2)[:, :, None], axis=1)
        part = jnp.where(mine[..., None], got, 0.0) + jnp.where(((r < Wc - 1) & (p == 0))[..., None], from_tail, 0.0)
        return self._total(part)

    # --------------------------------------------------------------------------------------------------- MLA
    def attention(self, q, k, v, *, scale: float, block_size: int, segment_ids=None):
        """Causal attention of the sequence-split queries q [B, T, N, H] over the whole keys k / values v
        [B, T, N, ·] (gathered: ``gather_seq``). Returns (o [B, T, N, V] split like q, max logit [B, N])."""
        B, T = q.shape[:2]
        self.check(T)
        L = T // self.n
        b, s, h = self._specs()
        docs = segment_ids is not None
        seg = jnp.zeros((B, T), jnp.int32) if not docs else jnp.asarray(segment_ids, jnp.int32)

        def local(q, k, v, seg):
            qoff = self._index() * L
            kw = {}
            if docs:
                kw = dict(segment_ids=lax.dynamic_slice_in_dim(seg, qoff, L, axis=1), key_segment_ids=seg)
            o, m = causal_attention(q, k, v, scale=scale, block_size=block_size, q_offset=qoff, **kw)
            return o, lax.pmax(lax.stop_gradient(m), self.seq_axes)

        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(P(b, s, h, None), P(b, None, h, None), P(b, None, h, None), P(b, None)),
                           out_specs=(P(b, s, h, None), P(b, h)))
        return fn(q, k, v, seg)

    def latent_flash(self, flash, q, c_kv, k_rope, w_uk, w_uv, *, segment_ids=None, balance: bool = True):
        """Causal MLA attention of the sequence-split queries q [B, T, N, Hn+Hr] over the latent c_kv [B, T, R] /
        k_rope [B, T, Hr] (any split on entry: all-gathered along T, the only thing that crosses the shards besides
        the balancing swap) by a flash kernel per shard: ``flash(q, c_kv, k_rope, w_uk, w_uv, segment_ids=,
        key_segment_ids=, q_offset=)`` → (o, max_logit), e.g. ``pallas_kernels.mla.mla_flash`` with its scale bound
        (it must run inside ``shard_map``: the TPU interpreter on a CPU). w_uk [R, N, Hn], w_uv [R, N, V].
        ``balance``: the mirror split (module docstring; a shard of fewer than 2 tokens stays contiguous). ``flash``
        also takes ``cost_offset`` (``mla_flash``'s), given each call's mean offset over the shards.
        Returns (o [B, T, N, V] split like q, max logit [B, N])."""
        B, T = q.shape[:2]
        self.check(T)
        L, n = T // self.n, self.n
        h0 = L // 2 if balance and L >= 2 else L          # the half a shard keeps; the other half h1 = L - h0 swaps
        b, s, h = self._specs()
        docs = segment_ids is not None
        seg = jnp.zeros((B, T), jnp.int32) if not docs else jnp.asarray(segment_ids, jnp.int32)

        def attend(qp, off, mean, c, r, wk, wv, seg):
            kw = {}
            if docs:
                kw = dict(segment_ids=lax.dynamic_slice_in_dim(seg, off, qp.shape[1], axis=1), key_segment_ids=seg)
            return flash(qp, c, r, wk, wv, q_offset=off, cost_offset=mean, **kw)

        def local(q, c, r, wk, wv, seg):
            p = self._index()
            # the cost estimate of each call: mirror-split, its offset's mean over the shards (the work is linear in
            # the offset, and a shard's two offsets sum to the same on every shard: each shard is charged its own
            # work); contiguous, the last shard's (the step waits for it)
            o, m = attend(q[:, :h0], p * L, (n - 1) * L // 2 if h0 < L else (n - 1) * L, c, r, wk, wv, seg)
            if h0 < L:                                    # shard p attends for shard n-1-p's second half
                swap = [(i, n - 1 - i) for i in range(n)]
                o1, m1 = attend(lax.ppermute(q[:, h0:], self.seq_axes, swap), (n - 1 - p) * L + h0,
                                (n - 1) * L // 2 + h0, c, r, wk, wv, seg)
                o = jnp.concatenate([o, lax.ppermute(o1, self.seq_axes, swap)], axis=1)
                m = jnp.maximum(m, m1)
            return o, lax.pmax(lax.stop_gradient(m), self.seq_axes)

        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(P(b, s, h, None), P(b, None, None), P(b, None, None), P(None, h, None),
                                     P(None, h, None), P(b, None)),
                           out_specs=(P(b, s, h, None), P(b, h)))
        return fn(q, c_kv, k_rope, w_uk, w_uv, seg)

    def latent_flash_cached(self, flash, q, c_kv, k_rope, w_uk, w_uv, *, start, balance: bool = True):
        """A cached prefill piece split over the shards: queries q [B, T, N, Hn+Hr] (token t of row b at position
        start[b] + t, start int32 [B]) over one layer's latent cache c_kv [B, S, R] / k_rope [B, S, Hr] (gathered
        along S on entry, as ``latent_attention``), by a flash kernel per shard with that shard's per-row offsets:
        ``flash(q, c_kv, k_rope, w_uk, w_uv, q_offset=[B])`` → (o, max_logit), e.g. ``backends.mla_flash`` with its
        scale bound. ``balance``: the mirror split of ``latent_flash`` (shard p keeps its first half, offsets start
        + p·L, and attends for shard n-1-p's second half, offsets start + (n-1-p)·L + L/2): every shard then sees
        about start + T/2 keys per query instead of start + (p + 1/2)·L; the price is one swap of half the queries and
        outputs. Inference only (no max logit). ``flash`` takes ``cost_offset`` (``mla_flash``'s: the offset its cost
        estimate charges; here each call's mean over the shards, for a piece starting at position 0). Returns o
        [B, T, N, V] split like q."""
        B, T = q.shape[:2]
        self.check(T)
        L, n = T // self.n, self.n
        h0 = L // 2 if balance and L >= 2 else L          # the half a shard keeps; the other half swaps
        b, s, h = self._specs()

        def local(q, c, r, wk, wv, st):
            p = self._index()
            # cost estimates as latent_flash's, for a piece from position 0
            o, _ = flash(q[:, :h0], c, r, wk, wv, q_offset=st + p * L,
                         cost_offset=(n - 1) * L // 2 if h0 < L else (n - 1) * L)
            if h0 < L:
                swap = [(i, n - 1 - i) for i in range(n)]
                o1, _ = flash(lax.ppermute(q[:, h0:], self.seq_axes, swap), c, r, wk, wv,
                              q_offset=st + (n - 1 - p) * L + h0, cost_offset=(n - 1) * L // 2 + h0)
                o = jnp.concatenate([o, lax.ppermute(o1, self.seq_axes, swap)], axis=1)
            return o

        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(P(b, s, h, None), P(b, None, None), P(b, None, None), P(None, h, None),
                                     P(None, h, None), P(b)),
                           out_specs=P(b, s, h, None))
        return fn(q, c_kv, k_rope, w_uk, w_uv, jnp.asarray(start, jnp.int32))

    def latent_attention(self, attend, q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, q_pos, kv_len):
        """``attend`` (``ops.latent_attention`` with its static settings) of the sequence-split queries over one
        layer's latent cache c_kv [B, S, R] / k_rope [B, S, Hr], gathered along S on entry (one all-gather per
        layer: 1.2 GB at 1M tokens of full K3). q_pos [B, T]: the queries' global positions."""
        b, s, h = self._specs()
        fn = jax.shard_map(lambda qn, qr, c, r, wk, wv, qp, kl: attend(qn, qr, c, r, wk, wv, q_pos=qp, kv_len=kl),
                           mesh=self.mesh,
                           in_specs=(P(b, s, h, None), P(b, s, h, None), P(b, None, None), P(b, None, None),
                                     P(None, h, None), P(None, h, None), P(b, s), P(b)),
                           out_specs=P(b, s, h, None))
        return fn(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos, kv_len)


__all__ = ["COMBINES", "ContextParallel", "causal_block_pairs", "split_axes"]
