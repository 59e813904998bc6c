"""Kimi Delta Attention core (SPEC §4.3–§4.6): recurrent, chunked (UT/WY) and one-step decode, in pure jnp.

Ladder (STYLE §3.2): ``k3jax.reference.kda`` (float64 NumPy loops) -> ``kda_recurrent`` (lax.scan over tokens)
-> ``kda_chunked`` (scan over 64-token chunks, matmul-heavy) -> ``pallas_kernels.kda`` (fused forward kernel).

Shapes (docstring letters, see k3jax/notation.py):
    q, k  [B, T, H, K]   l2-normalised keys/queries (any float dtype; all three of q, k, v share one dtype)
    v     [B, T, H, V]
    g     [B, T, H, K]   log decay per head AND key channel, g <= 0 (fp32 or wider is used internally)
    beta  [B, T, H]      write strength in [0, 1] (post-sigmoid)
    state [B, H, K, V]   K-first, rows indexed by key channel, fp32 (or wider)

State layout. k3jax's canonical state is K-first ``S[b, h, k, v]`` (fla's layout). The K3 reference modelling,
FlashKDA and vLLM store it V-first ``S'[b, h, v, k] = S[b, h, k, v]``: the transpose of the last two axes.
Convert only at interop boundaries with ``state_k_first_to_v_first`` / ``state_v_first_to_k_first``.

Precision. "fp32" means "at least fp32": the compute dtype is ``promote_types(q.dtype, float32)``, so bf16
inputs run in fp32 and float64 inputs (jax_enable_x64) stay float64 end to end. Outputs are cast back to q.dtype;
states are returned in the compute dtype.

Validation. Shapes, ranks and dtypes are always checked (ValueError naming the argument). Value checks (g <= 0,
beta in [0, 1], g >= gate_lower_bound) need concrete arrays and are skipped under tracing (inside jit/grad/vmap),
where a host round trip is not possible.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

SUB_CHUNK = 16  # diagonal sub-block size of SPEC §4.5 (the bounded-gate factorisation needs <= 16 at lb = -5)


# ---------------------------------------------------------------------------------------------------------------
# Layout helpers and validation
# ---------------------------------------------------------------------------------------------------------------


def state_k_first_to_v_first(state_bhkv):
    """[B, H, K, V] (k3jax / fla) -> [B, H, V, K] (K3 reference modelling, FlashKDA, vLLM)."""
    return jnp.swapaxes(state_bhkv, -1, -2)


def state_v_first_to_k_first(state_bhvk):
    """[B, H, V, K] -> [B, H, K, V]; inverse of ``state_k_first_to_v_first``."""
    return jnp.swapaxes(state_bhvk, -1, -2)


def compute_dtype(dtype):
    """At least float32 (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_float(name, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {x.dtype} (shape {tuple(x.shape)})")


def validate_inputs(q, k, v, g, beta, initial_state=None, *, has_time: bool = True, gate_lower_bound=None):
    """Checks ranks, shapes, dtypes and (when concrete) value ranges; raises ValueError naming the argument."""
    rank = 4 if has_time else 3
    lead = "[B, T, H, " if has_time else "[B, H, "
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.ndim != rank:
            raise ValueError(f"{name} must have rank {rank} ({lead}K or V]), got shape {tuple(x.shape)}")
    if beta.ndim != rank - 1:
        raise ValueError(f"beta must have rank {rank - 1} ({lead[:-2]}]), got shape {tuple(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, x)
    if k.shape != q.shape:
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g shape {tuple(g.shape)} must equal q shape {tuple(q.shape)} (one decay per key channel)")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v shape {tuple(v.shape)} must match q shape {tuple(q.shape)} except the last axis")
    if beta.shape != q.shape[:-1]:
        raise ValueError(f"beta shape {tuple(beta.shape)} must be q shape without K, {tuple(q.shape[:-1])}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if initial_state is not None:
        B, H, K, V = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
        if tuple(initial_state.shape) != (B, H, K, V):
            raise ValueError(f"initial_state shape {tuple(initial_state.shape)} must be K-first [B, H, K, V] = "
                             f"{(B, H, K, V)} (convert V-first states with state_v_first_to_k_first)")
        _check_float("initial_state", initial_state)
        if jnp.finfo(initial_state.dtype).bits < 32:
            raise ValueError(f"initial_state must be float32 or wider, got {initial_state.dtype}")
    if _is_concrete(g):
        g_np = np.asarray(g, dtype=np.float64)
        if g_np.size and np.nanmax(g_np) > 0:
            raise ValueError(f"g must be <= 0 (log decay); max is {np.nanmax(g_np):.3g} (shape {tuple(g.shape)})")
        if gate_lower_bound is not None and g_np.size and np.nanmin(g_np) < gate_lower_bound * (1 + 1e-6):
            raise ValueError(f"g must be >= gate_lower_bound {gate_lower_bound} on the bounded-gate path; min is "
                             f"{np.nanmin(g_np):.3g} (use gate_lower_bound=None for unbounded gates)")
    if _is_concrete(beta):
        b_np = np.asarray(beta, dtype=np.float64)
        if b_np.size and (np.nanmin(b_np) < 0 or np.nanmax(b_np) > 1):
            raise ValueError(f"beta must lie in [0, 1] (post-sigmoid); got range [{np.nanmin(b_np):.3g}, "
                             f"{np.nanmax(b_np):.3g}] (shape {tuple(beta.shape)})")


def _check_bound_and_sub_chunk(gate_lower_bound, sub_chunk):
    if gate_lower_bound is None:
        return
    if gate_lower_bound >= 0:
        raise ValueError(f"gate_lower_bound must be negative, got {gate_lower_bound}")
    # SPEC §4.5 item 2: the full diagonal span |lb|*(c-1)/ln 2 must stay below 126 (log2 units) in fp32.
    span = abs(gate_lower_bound) * (sub_chunk - 1) / np.log(2.0)
    if span >= 126:
        raise ValueError(f"gate_lower_bound {gate_lower_bound} with sub-chunk {sub_chunk} spans {span:.0f} log2 units "
                         ">= 126: the factorised diagonal would overflow in fp32; use gate_lower_bound=None")


# ---------------------------------------------------------------------------------------------------------------
# Recurrent form and one decode step (SPEC §4.3, §4.6)
# ---------------------------------------------------------------------------------------------------------------


def _step(S, q, k, v, g, beta, scale):
    """One token for all (B, H). S [B,H,K,V]; q,k,g [B,H,K]; v [B,H,V]; beta [B,H]. All in the compute dtype."""
    S = S * jnp.exp(g)[..., :, None]                        # S <- Diag(exp g) S
    e = v - jnp.einsum("bhkv,bhk->bhv", S, k)                # error on the decayed state
    S = S + (beta[..., None] * k)[..., :, None] * e[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", S, q * scale)            # read after the write
    return S, o


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None):
    """Token-by-token KDA (SPEC §4.3) as one ``lax.scan`` over T; each step updates every (B, H) at once.

    Args: see the module docstring. ``scale`` defaults to K^-0.5.
    Returns: o [B, T, H, V] in q.dtype, final state [B, H, K, V] in the compute dtype.
    Memory under autodiff is one state per token (the scan saves them); use ``kda_chunked`` for training.
    """
    validate_inputs(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    ct = compute_dtype(q.dtype)
    scale = K ** -0.5 if scale is None else scale
    S0 = jnp.zeros((B, H, K, V), ct) if initial_state is None else initial_state.astype(ct)
    xs = tuple(jnp.moveaxis(a.astype(ct), 1, 0) for a in (q, k, v, g, beta))

    def body(S, x):
        return _step(S, *x, scale)

    S, o = jax.lax.scan(body, S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), S


def kda_step(q, k, v, g, beta, state, *, scale=None):
    """One decode token (SPEC §4.6): natural-exp decay, delta write, read.

    Shapes: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] (K-first). A time axis of length 1
    ([B, 1, H, K], beta [B, 1, H]) is also accepted; the output then keeps it.
    Returns: o ([B, H, V] or [B, 1, H, V]) in q.dtype, new state in the compute dtype.
    """
    has_time = q.ndim == 4
    if has_time:
        if q.shape[1] != 1:
            raise ValueError(f"kda_step takes one token; q has T = {q.shape[1]} (shape {tuple(q.shape)})")
        validate_inputs(q, k, v, g, beta, state, has_time=True)
        q, k, v, g, beta = (a[:, 0] for a in (q, k, v, g, beta))
    else:
        validate_inputs(q, k, v, g, beta, None, has_time=False)
        B, H, K = q.shape
        if tuple(state.shape) != (B, H, K, v.shape[-1]):
            raise ValueError(f"state shape {tuple(state.shape)} must be K-first [B, H, K, V] = "
                             f"{(B, H, K, v.shape[-1])}")
    ct = compute_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S, o = _step(state.astype(ct), *(a.astype(ct) for a in (q, k, v, g, beta)), scale)
    o = o.astype(q.dtype)
    return (o[:, None] if has_time else o), S


# ---------------------------------------------------------------------------------------------------------------
# Chunked form (SPEC §4.4, §4.5)
# ---------------------------------------------------------------------------------------------------------------


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
    """(I + L)^-1 for strictly lower L [..., c, c] by the exact nilpotent product (SPEC §4.4):
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
    """X = (I + A)^-1 R for strictly lower A [..., C, C] and R [..., C // c, c, N] (rows in c-row blocks).

    Diagonal c x c blocks are inverted by the nilpotent product; then block forward substitution
    X_I = T_II (R_I - sum_{M < I} A_IM X_M). (Measured on this CPU for 256 chunks, C = 64, N = 256: 6.6 ms, vs
    8.6 ms for the full block inverse then one matmul, 17 ms for a 64 x 64 nilpotent product and 26 ms for
    lax.linalg.triangular_solve.) Returns X [..., C, N]."""
    *lead, n, _, N = R.shape
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


def chunk_intra(q, k, v, g, beta, *, scale, gate_lower_bound, sub_chunk=SUB_CHUNK):
    """State-independent per-chunk quantities (SPEC §4.4, §4.5), batched over any leading axes, all as matmuls.

    q, k, g: [..., C, K]; v: [..., C, V]; beta: [..., C] (compute dtype). Returns a dict with
      G_last [..., K], qg = s (Q ⊙ Γ) [..., C, K], kd = K ⊙ exp(G_last - G) [..., C, K],
      A_qk [..., C, C], W [..., C, K], U [..., C, V].

    Steps, with c-row sub-chunks I, J (c = 16) and r0(I) the first row of I:
      1. In-chunk sums of g: "after r0" and "after j" within each sub-chunk by shifted adds (``_prefix_sum``),
         sums of sub-chunk totals by 0/1 mask matmuls. Every exponent below is a sum of exactly the g_tau it
         spans, never a difference of two large cumsums (which would lose ~|G| * 6e-8, e.g. 6e-5 relative after a
         g = -1000 reset).
      2. Past columns (J < I), anchor r0(I): rows a_i = exp(G_i - G_r0(I)) <= 1; columns
         Y[I, j] = k_j exp(G_r0(I) - G_end(J)) exp(G_end(J) - G_j) <= 1 (each factor flushed below exp(-20) by
         ``_exp_flushed``, so no product is subnormal); columns J >= I are exact zeros. One batched matmul
         [c, K] x [K, C] per row sub-chunk gives all its past columns.
      3. Diagonal sub-blocks. Bounded gate: anchor G_r0 + delta, delta = lb (c - 1) / 2: row factor
         exp(G_i - G_r0 - delta) and column factor exp(G_r0 + delta - G_j) both in [e^delta, e^-delta]
         (|delta| = 37.5 at lb = -5, c = 16) for every pair, masked afterwards. Unbounded gate: exact pairwise
         decays exp(where(j <= i, G_i - G_j, -inf)), a [c, c, K] tensor per sub-chunk.
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
        P = mm("ijt,...ntk->...nijk", msk["pairs"], gs)             # sum_{j < t <= i}
        decay = _exp_flushed(jnp.where(jnp.asarray(ii[:, None] >= ii[None, :])[:, :, None], P, -jnp.inf))
        kdec = ks[..., None, :, :] * decay                          # [..., n, i, j, K]
        diag_k = jnp.einsum("...nik,...nijk->...nij", ks, kdec)
        diag_q = jnp.einsum("...nik,...nijk->...nij", qs, kdec)
    on_diag = jnp.asarray(np.eye(n, dtype=bool))[:, None, :, None]  # [I, 1, J, 1]

    def full(rows, diag):
        past_part = mm("...Iik,...Imk->...Iim", rows * a, Y).reshape(*lead, n, c, n, c)
        return jnp.where(on_diag, diag[..., :, :, None, :], past_part).reshape(*lead, C, C)

    # 4.
    jj = np.arange(C)
    A_kk = jnp.where(jnp.asarray(jj[:, None] > jj[None, :]), beta[..., :, None] * full(ks, diag_k), 0.0)
    A_qk = jnp.where(jnp.asarray(jj[:, None] >= jj[None, :]), full(qs, diag_q), 0.0)
    # 5.
    gam = _flush(_exp_flushed(pre + gs[..., :, 0, :])[..., None, :] * a)   # exp(G_i), chunk-inclusive
    R = jnp.concatenate([bs[..., None] * ks * gam, bs[..., None] * vs], axis=-1)   # [..., n, c, K + V]
    WU = _unit_lower_solve(A_kk, R, c)
    return {
        "G_last": G_last,
        "qg": (qs * gam).reshape(*lead, C, K),
        "kd": (kf * _exp_flushed(suf)[..., None, :]).reshape(*lead, C, K),   # k exp(G_last - G)
        "A_qk": A_qk,
        "W": WU[..., :K],
        "U": WU[..., K:],
    }


def _chunk_state_step(S, xs):
    """S [B,H,K,V] -> (S_next, (S_start, v_new)). xs: per-chunk W, U [B,H,C,*], kd^T [B,H,K,C] and the chunk's
    total decay exp(G_last) [B,H,K] (kd arrives transposed so both products are plain row-major matmuls)."""
    W, U, kdT, decay = xs
    v_new = U - jnp.einsum("bhck,bhkv->bhcv", W, S, preferred_element_type=S.dtype)          # Ṽ = U - W S
    S_next = decay[..., :, None] * S + jnp.einsum("bhkc,bhcv->bhkv", kdT, v_new, preferred_element_type=S.dtype)
    return S_next, (S, v_new)


def _pad_time(x, T_pad, value=0.0):
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, T_pad - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
                gate_lower_bound: float | None = None, sub_chunk: int = SUB_CHUNK, chunks_per_group: int = 4):
    """Chunked (UT/WY) KDA, SPEC §4.4 with the 16-token sub-chunk factorisation of §4.5.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay <= 0; beta: [B, T, H] in [0, 1].
      scale: defaults to K^-0.5. initial_state: [B, H, K, V] K-first, fp32 or wider (zeros if None).
      chunk_size: C, a multiple of ``sub_chunk``. Any T works: the tail is padded with g = 0, beta = 0,
        q = k = v = 0 (a no-op for the state) and the padded outputs are dropped.
      gate_lower_bound: lb of the K3 safe gate (e.g. -5.0). When given, diagonal sub-blocks are factorised around
        a past-row anchor + lb (c - 1) / 2; g must then lie in [lb, 0]. None (unbounded, softplus gate): exact
        pairwise decays on the diagonal sub-blocks.
      chunks_per_group: chunks processed together (see Structure); changes speed and memory, not results. The
        default 4 was the fastest of 2/4/8/16 on the CI CPU at T = 1024, 4096 and 16384 (experiments/LOG.md).
    Returns: o [B, T, H, V] in q.dtype; final state [B, H, K, V] in the compute dtype.

    Structure: chunks are taken in groups of up to ``chunks_per_group``. Inside a group, all state-independent
    work (A_kk, A_qk, the blocked inverse for W and U) runs batched over its chunks as matmuls; an unrolled
    ``lax.scan`` over the chunks carries the state; outputs O = s (Q ⊙ Γ) S_start + A_qk Ṽ are again batched.
    Groups are visited by a ``lax.scan`` whose body is ``jax.checkpoint``-ed, so autodiff stores one state per
    group (per chunk inside the group being recomputed), never one per token.
    """
    validate_inputs(q, k, v, g, beta, initial_state, gate_lower_bound=gate_lower_bound)
    if chunk_size % sub_chunk:
        raise ValueError(f"chunk_size {chunk_size} must be a multiple of sub_chunk {sub_chunk}")
    _check_bound_and_sub_chunk(gate_lower_bound, sub_chunk)
    B, T, H, K = q.shape
    V = v.shape[-1]
    ct = compute_dtype(q.dtype)
    scale = K ** -0.5 if scale is None else scale
    S0 = jnp.zeros((B, H, K, V), ct) if initial_state is None else initial_state.astype(ct)
    if T == 0:
        return jnp.zeros((B, 0, H, V), q.dtype), S0
    C = chunk_size
    NC = -(-T // C)
    # Groups of chunks: one group when T <= chunks_per_group * C, otherwise a scan over groups whose body is
    # rematerialised, so autodiff keeps one state per group plus the inputs (memory O(T (K + V))). Inputs stay in
    # the caller's [B, T, H, *] layout until a group is sliced off, and each group is transposed to head-major
    # [B, H, G, C, *] inside the body: the transposes then run on cache-sized blocks (whole-array transposes of
    # [B, T, H, K] cost ~4 ms each at T = 4096, H = 4, K = 128 on the CI CPU).
    NG = -(-NC // chunks_per_group)
    G_ = -(-NC // NG)
    Tp = NG * G_ * C
    intra_fn = functools.partial(chunk_intra, scale=scale, gate_lower_bound=gate_lower_bound, sub_chunk=sub_chunk)

    def group(S, xs):
        """One group of G chunks, inputs [B, G C, H, *]: batched intra-chunk matmuls, a scan for the states,
        batched outputs [B, G C, H, V]."""
        def head_major(x):                                                  # [B, G C, H, X] -> [B, H, G, C, X]
            return jnp.moveaxis(x.reshape(B, G_, C, H, x.shape[-1]), 3, 1)

        q_, k_, v_, g_, b_ = map(head_major, xs)
        intra = intra_fn(q_, k_, v_, g_, b_[..., 0])
        steps = (intra["W"], intra["U"], jnp.swapaxes(intra["kd"], -1, -2), _exp_flushed(intra["G_last"]))
        steps = tuple(jnp.moveaxis(x, 2, 0) for x in steps)
        S_next, (S_start, v_new) = jax.lax.scan(_chunk_state_step, S, steps, unroll=True)
        S_start = jnp.moveaxis(S_start, 0, 2)                               # [B, H, G, K, V]
        v_new = jnp.moveaxis(v_new, 0, 2)                                   # [B, H, G, C, V]
        o = (jnp.einsum("bhnck,bhnkv->bhncv", intra["qg"], S_start, preferred_element_type=ct)
             + jnp.einsum("bhncj,bhnjv->bhncv", intra["A_qk"], v_new, preferred_element_type=ct))
        return S_next, jnp.moveaxis(o, 1, 3).reshape(B, G_ * C, H, V)

    xs = tuple(_pad_time(x.astype(ct), Tp) for x in (q, k, v, g, beta[..., None]))
    if NG == 1:
        S_final, o = group(S0, xs)
    else:
        xs = tuple(jnp.moveaxis(x.reshape(B, NG, G_ * C, *x.shape[2:]), 1, 0) for x in xs)
        S_final, o = jax.lax.scan(jax.checkpoint(group), S0, xs)
        o = jnp.moveaxis(o, 0, 1).reshape(B, Tp, H, V)
    o = o[:, :T]
    return o.astype(q.dtype), S_final


@functools.partial(jax.jit, static_argnames=("chunk_size", "gate_lower_bound", "sub_chunk"))
def kda_chunked_jit(q, k, v, g, beta, initial_state=None, *, chunk_size=64, gate_lower_bound=None,
                    sub_chunk=SUB_CHUNK):
    """``kda_chunked`` under jit with the default scale (convenience for benchmarks)."""
    return kda_chunked(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size,
                       gate_lower_bound=gate_lower_bound, sub_chunk=sub_chunk)


# ---------------------------------------------------------------------------------------------------------------
# Gates and the short conv (SPEC §4.1, §4.2, §4.6), shared by the layer
# ---------------------------------------------------------------------------------------------------------------


def gate_safe(raw, dt_bias, A_log, lower_bound: float):
    """K3 safe gate: lb * sigmoid(exp(A_log[h]) * (raw + dt_bias[h, c])). raw [..., N, K]; dtype >= fp32."""
    ct = compute_dtype(raw.dtype)
    a = jnp.exp(A_log.astype(ct))[:, None]
    return lower_bound * jax.nn.sigmoid(a * (raw.astype(ct) + dt_bias.astype(ct)))


def gate_softplus(raw, dt_bias, A_log):
    """Kimi-Linear gate: -exp(A_log[h]) * softplus(raw + dt_bias[h, c]); jax.nn.softplus is overflow-safe."""
    ct = compute_dtype(raw.dtype)
    a = jnp.exp(A_log.astype(ct))[:, None]
    return -a * jax.nn.softplus(raw.astype(ct) + dt_bias.astype(ct))


def causal_conv_silu(u_btc, w_cw, tail_bwc=None):
    """Causal depthwise conv (tap W-1 hits the current token) + SiLU, with an optional cache.

    u_btc: [B, T, C] pre-conv inputs; w_cw: [C, W]; tail_bwc: [B, W-1, C] the previous W-1 inputs, oldest first
    (zeros when None). Returns (y [B, T, C] in >= fp32, new tail [B, W-1, C]: the last W-1 inputs of tail ++ u).
    """
    ct = compute_dtype(jnp.promote_types(u_btc.dtype, w_cw.dtype))
    B, T, C = u_btc.shape
    W = w_cw.shape[1]
    if tail_bwc is None:
        tail_bwc = jnp.zeros((B, W - 1, C), ct)
    elif tuple(tail_bwc.shape) != (B, W - 1, C):
        raise ValueError(f"conv cache shape {tuple(tail_bwc.shape)} must be [B, W-1, C] = {(B, W - 1, C)}")
    ext = jnp.concatenate([tail_bwc.astype(ct), u_btc.astype(ct)], axis=1)   # [B, T + W - 1, C]
    w = w_cw.astype(ct)
    y = sum(w[:, i] * ext[:, i:i + T, :] for i in range(W))
    return jax.nn.silu(y), ext[:, T:, :]


def l2norm(z, eps: float = 1e-6):
    """z / sqrt(sum z^2 + eps) over the last axis, in >= fp32."""
    z = z.astype(compute_dtype(z.dtype))
    return z * jax.lax.rsqrt(jnp.sum(z * z, axis=-1, keepdims=True) + eps)
