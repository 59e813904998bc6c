"""Chunked (UT/WY) KDA, docs/model.md §4.4 with the 16-token sub-chunk factorisation of §4.5.

Per chunk of C tokens the state-independent work is matmuls (``chunk_intra``: A_kk, A_qk and the unit-lower
solve for W, U); the state is carried chunk to chunk by ``_chunk_state_step``; ``kda_chunked`` groups chunks,
pads T and scans. Checked against ``kda_recurrent`` (fp32) and the float64 oracle. Shapes: see
``k3jax.ops.kda.common``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda.common import SUB_CHUNK, check_chunking, validate_inputs
from k3jax.ops.norms import acc_dtype
from k3jax.ops.segments import runs


def _masks(c: int, n: int, dtype):
    """0/1 matrices that turn the pairwise and per-sub-chunk sums into small matmuls (exact: products with 0/1 are
    exact and only the spanned terms are added, all of one sign, so rounding scales with the result)."""
    i = np.arange(c)
    m = np.arange(n)
    return {
        "pairs": jnp.asarray((i[None, :, None] < i[None, None, :]) & (i[None, None, :] <= i[:, None, None]),
                             dtype),                                              # [i, j, t]: j < t <= i
        "blk_before": jnp.asarray(m[None, :] < m[:, None], dtype),               # [I, M]: M < I
        "blk_after": jnp.asarray(m[None, :] > m[:, None], dtype),                # [J, M]: M > J
        "blk_between": jnp.asarray((m[None, :, None] < m[None, None, :]) & (m[None, None, :] < m[:, None, None]),
                                   dtype),                                        # [I, J, M]: J < M < I
    }


def _exp_flushed(x):
    """exp(x), with exponents below a dtype-dependent floor sent to exactly 0 (masked by `where` before exp).

    Products of several decay factors otherwise land in the subnormal range, and XLA:CPU runs subnormal
    arithmetic (matmuls included) ~100x slower: without this the chunked path ran 10x slower on saturating
    gates. The floor is exp(-20) = 2e-9 for fp32 (below fp32 rounding of the surviving terms, which are O(1)
    since every row keeps its own undecayed diagonal) and exp(-200) for float64 (no effect at 1e-12)."""
    floor = -20.0 if jnp.finfo(x.dtype).bits <= 32 else -200.0
    return jnp.exp(jnp.where(x < floor, -jnp.inf, x))


def _shift_down(x):
    """Rows moved one place down along axis -2, a zero row in front (the last row drops off)."""
    return jnp.pad(x[..., :-1, :], [(0, 0)] * (x.ndim - 2) + [(1, 0), (0, 0)])


def _prefix_sum(x):
    """Inclusive prefix sum over axis -2 by log2(n) shifted adds (Hillis-Steele): every output is a sum of
    exactly the terms it spans (no differences), and XLA:CPU fuses the chain into one loop."""
    n = x.shape[-2]
    shift = 1
    while shift < n:
        pad = [(0, 0)] * (x.ndim - 2) + [(shift, 0), (0, 0)]
        x = x + jnp.pad(x[..., : n - shift, :], pad)
        shift *= 2
    return x


def _flush(x):
    """Values below the ``_exp_flushed`` floor set to 0 (for products of flushed factors)."""
    floor = np.exp(-20.0) if jnp.finfo(x.dtype).bits <= 32 else np.exp(-200.0)
    return jnp.where(x < floor, 0.0, x)


def _invert_unit_lower(L):
    """(I + L)^-1 for strictly lower L [..., c, c] by the exact nilpotent product (docs/model.md §4.4):
    (I - L)(I + L^2)(I + L^4)(I + L^8)... = sum_{p < c} (-L)^p, since L^c = 0."""
    c = L.shape[-1]
    eye = jnp.eye(c, dtype=L.dtype)
    T = eye - L
    P = L
    span = 2
    while span < c:
        P = jnp.einsum("...ij,...jk->...ik", P, P)
        T = jnp.einsum("...ij,...jk->...ik", T, eye + P)
        span *= 2
    return T


def _unit_lower_solve(A, R, c):
    """X = (I + A)^-1 R for strictly lower A [..., C, C] and R [..., C // c, c, K + V] (rows in c-row blocks).

    Diagonal c x c blocks are inverted by the nilpotent product; then block forward substitution
    X_I = T_II (R_I - sum_{M < I} A_IM X_M). (Measured on this CPU for 256 chunks, C = 64, K + V = 256: 6.6 ms, vs
    8.6 ms for the full block inverse then one matmul, 17 ms for a 64 x 64 nilpotent product and 26 ms for
    lax.linalg.triangular_solve.) Returns X [..., C, K + V]."""
    *lead, n, _, _ = R.shape
    blocks = A.reshape(*lead, n, c, n, c)
    T_diag = _invert_unit_lower(jnp.stack([blocks[..., I, :, I, :] for I in range(n)], axis=-3))
    mm = functools.partial(jnp.einsum, preferred_element_type=A.dtype)
    X = []
    for I in range(n):
        acc = R[..., I, :, :]
        if I:
            acc = acc - mm("...ij,...jk->...ik", A[..., I * c:(I + 1) * c, : I * c], jnp.concatenate(X, axis=-2))
        X.append(mm("...ij,...jk->...ik", T_diag[..., I, :, :], acc))
    return jnp.concatenate(X, axis=-2)


def _diag_blocks(qs, ks, gs, L_r0, msk, gate_lower_bound):
    """Step 3 of ``chunk_intra``: the diagonal c x c sub-blocks of the k-k and q-k products.

    qs (scaled), ks, gs, L_r0 = G_i - G_r0(I): [..., n, c, K]. Bounded gate: anchor G_r0 + delta,
    delta = lb (c - 1) / 2, so the row factor exp(G_i - G_r0 - delta) and the column factor exp(G_r0 + delta - G_j)
    both lie in [e^delta, e^-delta] (|delta| = 37.5 at lb = -5, c = 16) for every pair, masked afterwards.
    Unbounded gate: exact pairwise decays exp(where(j <= i, G_i - G_j, -inf)), a [c, c, K] tensor per sub-chunk.
    Returns (a = exp(G_i - G_r0(I)) flushed [..., n, c, K], diag_k, diag_q [..., n, c, c]).
    """
    c = gs.shape[-2]
    mm = functools.partial(jnp.einsum, preferred_element_type=ks.dtype)
    ii = np.arange(c)
    if gate_lower_bound is not None:
        delta = gate_lower_bound * (c - 1) / 2.0
        # L_r0 >= lb (c - 1) (-75 at lb = -5): exp(L_r0) is a normal fp32 number. The column factor is its own
        # exp, not e^delta / exp(L_r0): the quotient's derivative 1 / exp(L_r0)^2 overflows fp32.
        a_raw = jnp.exp(L_r0)
        a = _flush(a_raw)                                           # exp(G_i - G_r0(I)) <= 1, for past columns
        rowf = a_raw * np.exp(-delta)                               # exp(G_i - G_r0 - delta)
        kcol = ks * jnp.exp(delta - L_r0)                           # exp(G_r0 + delta - G_j)
        diag_k = mm("...Iik,...Ijk->...Iij", ks * rowf, kcol)
        diag_q = mm("...Iik,...Ijk->...Iij", qs * rowf, kcol)
    else:
        a = _exp_flushed(L_r0)
        P = mm("ijt,...Itk->...Iijk", msk["pairs"], gs)             # sum_{j < t <= i}
        decay = _exp_flushed(jnp.where(jnp.asarray(ii[:, None] >= ii[None, :])[:, :, None], P, -jnp.inf))
        kdec = ks[..., None, :, :] * decay                          # [..., I, i, j, K]
        diag_k = jnp.einsum("...Iik,...Iijk->...Iij", ks, kdec)
        diag_q = jnp.einsum("...Iik,...Iijk->...Iij", qs, kdec)
    return a, diag_k, diag_q


def chunk_intra(q, k, v, g, beta, *, scale, gate_lower_bound, sub_chunk=SUB_CHUNK, docs=None):
    """State-independent per-chunk quantities (docs/model.md §4.4, §4.5), batched over any leading axes, all as matmuls.

    q, k, g: [..., C, K]; v: [..., C, V]; beta: [..., C] (compute dtype). Returns a dict with
      G_last [..., K], qg = s (Q ⊙ Γ) [..., C, K], kd = K ⊙ exp(G_last - G) [..., C, K],
      A_qk [..., C, C], W [..., C, K], U [..., C, V].
    docs (packed rows, ``doc_masks``): {"run": [..., C] document index, "carry": [..., C] 1 where a row continues
      the document of the chunk's incoming state, "last": [..., C] 1 where a row is in the chunk's last document}
      (any leading axes that broadcast). Pairs across documents drop out of A_kk and A_qk, rows of a new document
      see no incoming state (Γ = 0 there: qg and W's K part are zero) and only the last document writes the
      outgoing state (kd = 0 elsewhere); the caller zeroes the state's decay when the chunk's last row does not
      carry. The gates are untouched (K3's bounded gate never decays to zero), so every factor stays finite and
      the masks only multiply by exact zeros and ones.

    Steps, with c-row sub-chunks I, J (c = 16) and r0(I) the first row of I:
      1. In-chunk sums of g: "after r0" and "after j" within each sub-chunk by shifted adds (``_prefix_sum``),
         sums of sub-chunk totals by 0/1 mask matmuls. Every exponent below is a sum of exactly the g_tau it
         spans, never a difference of two large cumsums (which would lose ~|G| * 6e-8, e.g. 6e-5 relative after a
         g = -1000 reset).
      2. Past columns (J < I), anchor r0(I): rows a_i = exp(G_i - G_r0(I)) <= 1; columns
         Y[I, j] = k_j exp(G_r0(I) - G_end(J)) exp(G_end(J) - G_j) <= 1 (each factor flushed below exp(-20) by
         ``_exp_flushed``, so no product is subnormal); columns J >= I are exact zeros. One batched matmul
         [c, K] x [K, C] per row sub-chunk gives all its past columns.
      3. Diagonal sub-blocks (``_diag_blocks``): bounded gate factorised around G_r0 + lb (c - 1) / 2, unbounded
         gate by exact pairwise decays.
      4. A_kk = beta_i * (k-k products, j < i); A_qk = s * (q-k products, j <= i).
      5. W, U = (I + A_kk)^-1 [beta K Γ, beta V] by ``_unit_lower_solve``.
    Every anchor is a row at or before the rows it serves, so outputs never depend on later tokens (causality).
    Exps are the costly elementwise op on CPU (~3.5 ns each, single-threaded fusions), so the bounded path takes
    three per element (a, its inverse, f) and forms the other factors as products.
    """
    *lead, C, K = q.shape
    c = sub_chunk
    n = C // c
    ct = q.dtype
    msk = _masks(c, n, ct)
    mm = functools.partial(jnp.einsum, preferred_element_type=ct)
    sub = lambda x: x.reshape(*lead, n, c, x.shape[-1])  # noqa: E731
    qs, ks, vs, gs = map(sub, (q, k, v, g))
    bs = beta.reshape(*lead, n, c)
    qs = scale * qs
    # 1. sums of g.
    L_r0 = _prefix_sum(gs.at[..., 0, :].set(0.0))                 # G_i - G_r0(I) = sum_{r0 < t <= i}
    R_ex = jnp.flip(_prefix_sum(_shift_down(jnp.flip(gs, -2))), -2)  # G_end(J) - G_j = sum_{j < t <= end(J)}
    tot = jnp.sum(gs, axis=-2)                                      # [..., n, K]
    pre = mm("IM,...Mk->...Ik", msk["blk_before"], tot)             # sum over sub-chunks before I
    suf = mm("JM,...Mk->...Jk", msk["blk_after"], tot)              # sum over sub-chunks after J
    between = mm("IJM,...Mk->...IJk", msk["blk_between"], tot)      # strictly between J and I
    G_last = jnp.sum(tot, axis=-2)
    # 2. past columns [..., I, J, j, K].
    blk = np.arange(n)
    past = jnp.asarray(blk[None, :] < blk[:, None])                 # [I, J]: J < I
    e_IJ = _exp_flushed(jnp.where(past[:, :, None], between + gs[..., :, None, 0, :], -jnp.inf))
    kf = ks * _exp_flushed(R_ex)                                    # k_j exp(G_end(J) - G_j)
    Y = (e_IJ[..., :, :, None, :] * kf[..., None, :, :, :]).reshape(*lead, n, C, K)
    # 3. diagonal blocks [..., I, i, j].
    a, diag_k, diag_q = _diag_blocks(qs, ks, gs, L_r0, msk, gate_lower_bound)
    on_diag = jnp.asarray(np.eye(n, dtype=bool))[:, None, :, None]  # [I, 1, J, 1]

    def full(rows, diag):
        past_part = mm("...Iik,...Imk->...Iim", rows * a, Y).reshape(*lead, n, c, n, c)
        return jnp.where(on_diag, diag[..., :, :, None, :], past_part).reshape(*lead, C, C)

    # 4.
    jj = np.arange(C)
    lower, lower_eq = jnp.asarray(jj[:, None] > jj[None, :]), jnp.asarray(jj[:, None] >= jj[None, :])
    if docs is not None:
        same = docs["run"][..., :, None] == docs["run"][..., None, :]
        lower, lower_eq = lower & same, lower_eq & same
    A_kk = jnp.where(lower, beta[..., :, None] * full(ks, diag_k), 0.0)
    A_qk = jnp.where(lower_eq, full(qs, diag_q), 0.0)
    # 5.
    gam = _flush(_exp_flushed(pre + gs[..., :, 0, :])[..., None, :] * a)   # exp(G_i), chunk-inclusive
    if docs is not None:
        carry = docs["carry"]
        gam = gam * carry.reshape(*carry.shape[:-1], n, c, 1).astype(ct)
    R = jnp.concatenate([bs[..., None] * ks * gam, bs[..., None] * vs], axis=-1)   # [..., n, c, K + V]
    WU = _unit_lower_solve(A_kk, R, c)
    kd = (kf * _exp_flushed(suf)[..., None, :]).reshape(*lead, C, K)     # k exp(G_last - G)
    return {
        "G_last": G_last,
        "qg": (qs * gam).reshape(*lead, C, K),
        "kd": kd if docs is None else kd * docs["last"][..., None].astype(ct),
        "A_qk": A_qk,
        "W": WU[..., :K],
        "U": WU[..., K:],
    }


def _chunk_state_step(S, xs):
    """S [B,N,K,V] -> (S_next, (S_start, v_new)). xs: per-chunk W, U [B,N,C,*], kd^T [B,N,K,C] and the chunk's
    total decay exp(G_last) [B,N,K] (kd arrives transposed so both products are plain row-major matmuls)."""
    W, U, kdT, decay = xs
    v_new = U - jnp.einsum("bnck,bnkv->bncv", W, S, preferred_element_type=S.dtype)          # Ṽ = U - W S
    S_next = decay[..., :, None] * S + jnp.einsum("bnkc,bncv->bnkv", kdT, v_new, preferred_element_type=S.dtype)
    return S_next, (S, v_new)


def _pad_time(x, T_pad, value=0.0):
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, T_pad - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def doc_masks(segment_ids, T_pad: int, C: int):
    """Per-token document masks of packed rows for ``chunk_intra`` (``docs``), each [B, T_pad] int32: the run index
    (``k3jax.ops.segments.runs``; padding continues the last run), ``carry`` (1 where a token is in the document
    the state entering its chunk belongs to: the run of the token before the chunk, 0 for the first chunk, as
    the initial state continues run 0) and ``last`` (1 where a token is in its chunk's last document)."""
    run = runs(segment_ids)
    run = jnp.pad(run, [(0, 0), (0, T_pad - run.shape[1])], mode="edge")
    B = run.shape[0]
    chunks = run.reshape(B, T_pad // C, C)
    before = jnp.concatenate([jnp.zeros_like(chunks[:, :1, -1]), chunks[:, :-1, -1]], axis=1)   # [B, NC]
    carry = (chunks == before[:, :, None]).astype(jnp.int32).reshape(B, T_pad)
    last = (chunks == chunks[:, :, -1:]).astype(jnp.int32).reshape(B, T_pad)
    return run, carry, last


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
                gate_lower_bound: float | None = None, sub_chunk: int = SUB_CHUNK, chunks_per_group: int = 4,
                segment_ids=None):
    """Chunked (UT/WY) KDA, docs/model.md §4.4 with the 16-token sub-chunk factorisation of §4.5.

    Args:
      q, k: [B, T, N, K]; v: [B, T, N, V]; g: [B, T, N, K] log decay <= 0; beta: [B, T, N] in [0, 1].
      scale: defaults to K^-0.5. initial_state: [B, N, K, V] K-first, fp32 or wider (zeros if None).
      chunk_size: C, a multiple of ``sub_chunk``. Any T works: the tail is padded with g = 0, beta = 0,
        q = k = v = 0 (a no-op for the state) and the padded outputs are dropped.
      gate_lower_bound: lb of the K3 safe gate (e.g. -5.0). When given, diagonal sub-blocks are factorised around
        a past-row anchor + lb (c - 1) / 2; g must then lie in [lb, 0]. None (unbounded, softplus gate): exact
        pairwise decays on the diagonal sub-blocks.
      chunks_per_group: chunks processed together (see Structure); changes speed and memory, not results. The
        default 4 was the fastest of 2/4/8/16 on the CI CPU at T = 1024, 4096 and 16384 (experiments/LOG.md).
      segment_ids: None, or [B, T] document ids of packed rows (docs/model.md §4.7, ``k3jax.ops.segments``): every
        document runs from a zero state (the initial state continues the first), by exact masks inside each chunk
        (``chunk_intra``'s ``docs``) and a zeroed decay where a chunk ends in a later document than it started;
        the final state is the last document's.
    Returns: o [B, T, N, V] in q.dtype; final state [B, N, K, V] in ``acc_dtype(q.dtype)``.

    Structure: chunks are taken in groups of up to ``chunks_per_group``. Inside a group, all state-independent
    work (A_kk, A_qk, the blocked inverse for W and U) runs batched over its chunks as matmuls; an unrolled
    ``lax.scan`` over the chunks carries the state; outputs O = s (Q ⊙ Γ) S_start + A_qk Ṽ are again batched.
    Groups are visited by a ``lax.scan`` whose body is ``jax.checkpoint``-ed, so autodiff stores one state per
    group (per chunk inside the group being recomputed), never one per token.
    """
    validate_inputs(q, k, v, g, beta, initial_state, gate_lower_bound=gate_lower_bound)
    check_chunking(chunk_size, sub_chunk, gate_lower_bound)
    B, T, N, K = q.shape
    V = v.shape[-1]
    ct = acc_dtype(q.dtype)
    scale = K ** -0.5 if scale is None else scale
    S0 = jnp.zeros((B, N, K, V), ct) if initial_state is None else initial_state.astype(ct)
    if T == 0:
        return jnp.zeros((B, 0, N, V), q.dtype), S0
    C = chunk_size
    NC = -(-T // C)
    # Groups of chunks: one group when T <= chunks_per_group * C, otherwise a scan over groups whose body is
    # rematerialised, so autodiff keeps one state per group plus the inputs (memory O(T (K + V))). Inputs stay in
    # the caller's [B, T, N, *] layout until a group is sliced off, and each group is transposed to head-major
    # [B, N, G, C, *] inside the body: the transposes then run on cache-sized blocks (whole-array transposes of
    # [B, T, N, K] cost ~4 ms each at T = 4096, N = 4, K = 128 on the CI CPU).
    NG = -(-NC // chunks_per_group)
    G_ = -(-NC // NG)
    Tp = NG * G_ * C
    intra_fn = functools.partial(chunk_intra, scale=scale, gate_lower_bound=gate_lower_bound, sub_chunk=sub_chunk)

    def group(S, xs):
        """One group of G chunks, inputs [B, G C, N, *]: batched intra-chunk matmuls, a scan for the states,
        batched outputs [B, G C, N, V]."""
        def head_major(x):                                                  # [B, G C, N, X] -> [B, N, G, C, X]
            return jnp.moveaxis(x.reshape(B, G_, C, N, x.shape[-1]), 3, 1)

        q_, k_, v_, g_, b_ = map(head_major, xs[:5])
        docs = None
        if len(xs) > 5:                                                     # [B, G C] -> [B, 1, G, C]
            docs = dict(zip(("run", "carry", "last"), (d.reshape(B, 1, G_, C) for d in xs[5:]), strict=True))
        intra = intra_fn(q_, k_, v_, g_, b_[..., 0], docs=docs)
        decay = _exp_flushed(intra["G_last"])
        if docs is not None:                                                # a new document: no incoming state
            decay = decay * docs["carry"][..., -1:].astype(ct)
        steps = (intra["W"], intra["U"], jnp.swapaxes(intra["kd"], -1, -2), decay)
        steps = tuple(jnp.moveaxis(x, 2, 0) for x in steps)
        S_next, (S_start, v_new) = jax.lax.scan(_chunk_state_step, S, steps, unroll=True)
        S_start = jnp.moveaxis(S_start, 0, 2)                               # [B, N, G, K, V]
        v_new = jnp.moveaxis(v_new, 0, 2)                                   # [B, N, G, C, V]
        o = (jnp.einsum("bngck,bngkv->bngcv", intra["qg"], S_start, preferred_element_type=ct)
             + jnp.einsum("bngcj,bngjv->bngcv", intra["A_qk"], v_new, preferred_element_type=ct))
        return S_next, jnp.moveaxis(o, 1, 3).reshape(B, G_ * C, N, V)

    xs = tuple(_pad_time(x.astype(ct), Tp) for x in (q, k, v, g, beta[..., None]))
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (B, T):
            raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} must be [B, T] = {(B, T)}")
        xs = (*xs, *doc_masks(segment_ids, Tp, C))
    if NG == 1:
        S_final, o = group(S0, xs)
    else:
        xs = tuple(jnp.moveaxis(x.reshape(B, NG, G_ * C, *x.shape[2:]), 1, 0) for x in xs)
        S_final, o = jax.lax.scan(jax.checkpoint(group), S0, xs)
        o = jnp.moveaxis(o, 0, 1).reshape(B, Tp, N, V)
    o = o[:, :T]
    return o.astype(q.dtype), S_final
