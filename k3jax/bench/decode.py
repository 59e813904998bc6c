"""`k3 bench decode --json` — inference cost of the hybrid cache (k3jax/model/cache.py) on k3-mini, random init,
float32: per-token decode time vs context and batch, the cost of a large preallocated cache, absorbed vs
materialized MLA decode, prefill tokens/s.

    k3 bench decode --json          # contexts 1K, 16K, 64K x batch 1, 8; prefill 512, 2K, 8K (2.5 min on an idle
                                    # 2-core CPU, 11 compiled programs of ~7 s each; 4-8 min when it is shared)
    k3 bench decode --json --preset k3-tiny --contexts 4,5 --batches 1 --prefill 1 --rounds 1 --steps 1
                                    # the test's size: every figure from two compiled programs

Decode: the compiled program ``decode_step(..., donate=True)`` runs (``cache._extend`` with the cache donated,
``last_only``) is timed directly, one token per row, ``--rounds`` x ``--steps`` timed steps per configuration after
one warm step; the configurations are timed round-robin, so a burst of load on a shared machine hits all of them.
The caches for long contexts are filled synthetically (``"cache_fill": "synthetic"``; a real 64K x 8 prefill
would take hours on a CPU): unit-RMS random latents ``c_kv`` / ``k_rope`` at positions < context, zeros beyond (a
block of 4096 random positions repeated along the context), random KDA states (entries N(0, 1/K)) and conv tails
(unit RMS), ``lengths`` = context. Each cache holds the context plus the steps timed on it (rounded up to the
attention key block), except the "1k in 64k cache" one: the largest context's cache holding the smallest context.
Prefill runs real prompts (B = 1, random ids) into an empty cache, ``last_only``.

Contexts play fixed roles in the ratio names: the smallest is "1k", the second "16k", the largest cache "64k"
(``config.ratio_contexts`` says which values ran). ``ratios``:

- ``decode_time_16k_over_1k``: headline at the largest batch (per batch: ``..._b{B}``); target <= 1.3;
- ``decode_time_1k_in_64k_cache_over_1k_cache``: headline = the worst (max) over batches; target <= 1.2;
- ``absorbed_over_materialized_16k``: decode time with the absorbed MLA form over the materialized one, headline at
  the largest batch (the one where the cache read dominates);
- ``decode_time_64k_over_1k_b{B}``.

The bytes floor: where a decode step's time is the bytes it reads over a bandwidth (decode's regime on
accelerators), ``t_16k / t_1k >= (W + B 16k m) / (W + B 1k m)`` for W weight bytes read and m MLA cache bytes per
token. ``profile.per_batch.B{B}.bytes_floor_16k_over_1k`` gives it with W = every weight (the lowest it can be) and
with W = the weights a step of B rows touches (``weight_bytes_touched``), and ``checks.decode_time_16k_over_1k``
says whether the target lies below the all-weights floor. It does for k3-mini at B = 8 in float32: its 16K x 8
latents (252 MB) outweigh all of its weights (144 MB), floor 2.48 > 1.3 — the issue's target assumes a model whose
weights dominate the cache (kimi-k3 at 16K x 8: ~137 GB of active weights against 3.6 GB of latents, floor ~1.03).

``ok`` is false, and ``k3 bench decode`` exits 1, when a target is missed or logits are not finite (the figures are
printed anyway).

``profile`` explains the figures: per batch and context the MLA attention op alone (``ops.latent_attention`` on the
same shapes, times the number of MLA layers) and its share of the step; the MLA cache bytes a step must read; a
streaming-read bandwidth measured in the same run and the ratio floor it implies,
``(t_1k + extra cache bytes / bandwidth) / t_1k``; and per compiled decode program XLA's temp bytes and the
cache-sized copy / concatenate instructions of its HLO (a donated cache updated in place has neither).
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.bench.common import time_median
from k3jax.config import default_run, get_preset
from k3jax.errors import InputError, int_list
from k3jax.layers.mla import big_key_block
from k3jax.model import count_params, init_params
from k3jax.model.cache import cache_bytes, cache_shapes, capacity, extend_donated, layer_cache_shapes
from k3jax.ops.latent_attention import latent_attention

TILE = 4096  # positions of random latents drawn per cache; longer contexts repeat them
TARGETS = {"decode_time_16k_over_1k": 1.3, "decode_time_1k_in_64k_cache_over_1k_cache": 1.2}


def _int_list(s: str) -> list[int]:
    """``errors.int_list`` as an argparse type: its message on argparse's ``argument --contexts: ...`` line."""
    try:
        return int_list(s, minimum=1)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="k3-mini", help="model preset (random init)")
    parser.add_argument("--contexts", type=_int_list, default=[1024, 16384, 65536],
                        help="decode contexts, comma-separated (at least two: the smallest is '1k', the second "
                             "'16k', the largest cache '64k')")
    parser.add_argument("--batches", type=_int_list, default=[1, 8], help="decode batches, comma-separated")
    parser.add_argument("--prefill", type=_int_list, default=[512, 2048, 8192], help="prefill prompt lengths (B = 1)")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds over the configurations")
    parser.add_argument("--steps", type=int, default=2, help="timed decode steps per configuration and round")
    parser.add_argument("--prefill-reps", type=int, default=1,
                        help="timed prefill runs per prompt length, at least (short prompts: more, up to 5 or 3 s)")


# ------------------------------------------------------------------------------------------------- synthetic cache

def synthetic_cache(cfg, batch: int, max_len: int, context: int, run, seed: int = 0):
    """A cache of ``batch`` rows holding ``context`` tokens each, filled with random values of realistic scale
    (module docstring) instead of a prefill. Drawn with NumPy on the host: eager jax ops would compile one program
    per leaf shape."""
    rng = np.random.default_rng(seed)
    shapes = cache_shapes(cfg, batch, max_len, run)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for path, s in leaves:
        name = path[-1].key
        if name == "lengths":
            x = np.full(s.shape, context, s.dtype)
        elif name in ("c_kv", "k_rope"):                  # [..., S, R]: random below the context, zero above
            tile = min(context, TILE)                      # a random block repeated: drawing 1 GB takes long
            block = rng.standard_normal((*s.shape[:-2], tile, s.shape[-1]), np.float32).astype(s.dtype)
            x = np.zeros(s.shape, s.dtype)
            for a in range(0, context, tile):
                n = min(tile, context - a)
                x[..., a:a + n, :] = block[..., :n, :]
        elif name == "state":                              # [..., N, K, V]
            x = (rng.standard_normal(s.shape, np.float32) / math.sqrt(s.shape[-2])).astype(s.dtype)
        else:                                              # conv tails
            x = rng.standard_normal(s.shape, np.float32).astype(s.dtype)
        out.append(jnp.asarray(x))
    return jax.tree_util.tree_unflatten(treedef, out)


def _zero_cache(cfg, batch: int, max_len: int, run):
    """``init_cache`` without eager jax ops (host zeros, then one transfer per leaf)."""
    return jax.tree.map(lambda s: jnp.asarray(np.zeros(s.shape, s.dtype)), cache_shapes(cfg, batch, max_len, run))


# -------------------------------------------------------------------------------------------------- HLO diagnostics

def cache_sized_ops(hlo_text: str, S: int, widths) -> dict[str, int]:
    """Count of copy / concatenate instructions of a compiled HLO module whose result holds a latent-cache-shaped
    [..., S, w] block (S the cache's positions, w in ``widths``, e.g. (R, Hr)): each one moves a whole cache buffer
    per step, where a donated cache updated in place needs none."""
    out: dict[str, int] = {}
    pat = re.compile(r"= [a-z0-9]+\[([0-9,]*)\]\S* (copy|concatenate)\(")
    for line in hlo_text.splitlines():
        m = pat.search(line)
        if not m:
            continue
        dims = [int(d) for d in m.group(1).split(",") if d]
        if any(a == S and b in widths for a, b in zip(dims, dims[1:])):
            out[m.group(2)] = out.get(m.group(2), 0) + 1
    return out


# ----------------------------------------------------------------------------------------------------------- decode

class _Decode:
    """One timed decode configuration: a compiled donated step and the cache it advances."""

    def __init__(self, program, cache, batch: int):
        self.program, self.cache, self.batch = program, cache, batch
        self.ids = jnp.asarray(np.zeros((batch, 1), np.int32))
        self.ones = jnp.asarray(np.ones((batch,), np.int32))
        self.times: list[float] = []
        self.finite = True

    def step(self, params, *, timed: bool):
        t0 = time.perf_counter()
        logits, self.cache = self.program(params, self.ids, self.ones, self.cache)
        jax.block_until_ready(logits)
        if timed:
            self.times.append(time.perf_counter() - t0)
        self.finite = self.finite and bool(np.isfinite(np.asarray(logits)).all())


def _compile_extend(params, cfg, run, cache, T: int, *, absorbed: bool):
    """``cache.extend_donated`` (the cache donated) with ``last_only``, compiled for pieces [B, T] on ``cache``'s
    shapes: with T = 1 the program ``decode_step(..., donate=True)`` runs, with T > 1 a prefill (without the copy of the
    cache that an undonated call makes)."""
    B = cache["lengths"].shape[0]
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
    n = jax.ShapeDtypeStruct((B,), jnp.int32)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cache)
    return extend_donated.lower(params, ids, n, abstract, cfg=cfg, run=run, absorbed=absorbed,
                                last_only=True).compile()


def _attention_alone(cfg, run, B: int, S: int, context: int, *, reps: int) -> float:
    """Seconds of ``ops.latent_attention`` for one decode token per row against ``context`` cached keys, summed over
    the MLA layers (the same shapes and key blocks as the model's decode step)."""
    N, Hn, Hr, V, R = (cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                       cfg.kv_lora_rank)
    rng = np.random.default_rng(7)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    x = (normal(B, 1, N, Hn), normal(B, 1, N, Hr), normal(B, S, R), normal(B, S, Hr),
         normal(R, N, Hn) / math.sqrt(R), normal(R, N, V) / math.sqrt(R))
    q_pos = jnp.asarray(np.full((B, 1), context - 1, np.int32))
    kv_len = jnp.asarray(np.full((B,), context, np.int32))
    return cfg.num_mla_layers * time_median(_attention_fn(1.0 / math.sqrt(Hn + Hr), run.mla_block_size), *x,
                                            q_pos, kv_len, reps=reps)


@functools.lru_cache
def _attention_fn(scale: float, block: int):
    return jax.jit(lambda qn, qr, c, kr, wk, wv, q_pos, kv_len: latent_attention(
        qn, qr, c, kr, wk, wv, q_pos=q_pos, kv_len=kv_len, scale=scale, block=block,
        big_block=big_key_block(1, block), absorbed=True))


def _read_bandwidth(nbytes: int, *, reps: int) -> float:
    """Bytes/s of a jitted full reduction over an f32 buffer of about ``nbytes`` (a streaming read)."""
    x = jnp.asarray(np.ones((max(nbytes // 4, 1 << 20),), np.float32))
    return x.nbytes / time_median(jax.jit(jnp.sum), x, reps=reps)


# ---------------------------------------------------------------------------------------------------------------- run

def run(args) -> dict:
    contexts = sorted(set(args.contexts))
    batches = sorted(set(args.batches))
    if len(contexts) < 2:
        raise InputError(f"--contexts needs at least two values (the '1k' and '16k' roles), got {args.contexts}")
    if args.rounds < 1 or args.steps < 1 or args.prefill_reps < 1:
        raise InputError("--rounds, --steps and --prefill-reps must be >= 1")
    cfg = get_preset(args.preset)
    run_cfg = default_run(cfg)
    if cfg.num_mla_layers == 0:
        raise InputError(f"--preset {args.preset} has no MLA layer: nothing in its cache grows with the context")
    c1k, c16k, c64k = contexts[0], contexts[1], contexts[-1]
    t_start = time.perf_counter()
    log = lambda msg: print(f"[decode {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    params = init_params(cfg, jax.random.key(0), run_cfg)
    n_params = count_params(params)
    param_bytes = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))
    per_config_steps = 1 + args.rounds * args.steps          # one warm step + the timed ones
    tight = {c: capacity(cfg, c + per_config_steps, run_cfg) for c in contexts}
    big = tight[c64k]

    # 1. the decode configurations: (name, batch, context, cache capacity, absorbed)
    specs = []
    for B in batches:
        specs += [(f"B{B}_ctx{c}", B, c, tight[c], True) for c in contexts]
        specs.append((f"B{B}_ctx{c1k}_in_{big}_cache", B, c1k, big, True))
        specs.append((f"B{B}_ctx{c16k}_materialized", B, c16k, tight[c16k], False))
    programs, configs, hlo = {}, {}, {}
    for i, (name, B, ctx, S, absorbed) in enumerate(specs):
        cache = synthetic_cache(cfg, B, S, ctx, run_cfg, seed=i)
        pk = (B, S, 1, absorbed)
        if pk not in programs:
            t0 = time.perf_counter()
            programs[pk] = _compile_extend(params, cfg, run_cfg, cache, 1, absorbed=absorbed)
            mem = programs[pk].memory_analysis()
            hlo[f"B{B}_S{S}_{'absorbed' if absorbed else 'materialized'}"] = {
                "cache_bytes": cache_bytes(cache), "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)),
                "cache_sized_ops": cache_sized_ops(programs[pk].as_text(), S,
                                                   (cfg.kv_lora_rank, cfg.qk_rope_head_dim)),
                "compile_s": time.perf_counter() - t0}
            log(f"compiled decode B={B} S={S} absorbed={absorbed} in {time.perf_counter() - t0:.1f}s")
        configs[name] = _Decode(programs[pk], cache, B)
        configs[name].step(params, timed=False)             # warm: first run of the program on this cache
    for r in range(args.rounds):
        for dec in configs.values():
            for _ in range(args.steps):
                dec.step(params, timed=True)
        log(f"decode round {r + 1}/{args.rounds} done")
    decode = {name: {"batch": B, "context": ctx, "cache_positions": S, "absorbed": absorbed,
                     "median_s": statistics.median(configs[name].times), "min_s": min(configs[name].times),
                     "steps": len(configs[name].times), "logits_finite": configs[name].finite}
              for name, B, ctx, S, absorbed in specs}
    for dec in configs.values():
        dec.cache = None                                    # free the caches before prefill
    t = lambda name: decode[name]["median_s"]  # noqa: E731

    # 2. prefill: a real prompt into an empty cache through the chunked KDA / blockwise MLA path (the materialized
    # MLA form, prefill's default), last token's logits only; a fresh cache per run (the program donates it)
    prefill_out = {}
    for T in sorted(set(args.prefill)):
        tokens = jnp.asarray(np.random.default_rng(T).integers(0, cfg.vocab_size, (1, T), dtype=np.int32))
        n = jnp.asarray(np.full((1,), T, np.int32))
        S = capacity(cfg, T, run_cfg)
        pk = (1, S, T, False)
        if pk not in programs:
            programs[pk] = _compile_extend(params, cfg, run_cfg, cache_shapes(cfg, 1, T, run_cfg), T,
                                           absorbed=False)
        # Compiled ahead of time, so a warm-up run only for short prompts (8K takes ~20-30 s here); then at least
        # --prefill-reps runs, more (up to 5) until 3 s are spent, so short prompts get a median of several.
        times, warmed = [], False
        while len(times) < args.prefill_reps or (sum(times) < 3.0 and len(times) < 5):
            cache0 = jax.block_until_ready(_zero_cache(cfg, 1, T, run_cfg))
            t0 = time.perf_counter()
            logits, _ = programs[pk](params, tokens, n, cache0)
            jax.block_until_ready(logits)
            sec = time.perf_counter() - t0
            if not warmed and sec < 5.0:
                warmed = True
                continue
            times.append(sec)
        sec = statistics.median(times)
        prefill_out[f"T{T}"] = {"seconds": sec, "tokens_per_s": T / sec, "runs": len(times),
                                "logits_finite": bool(np.isfinite(np.asarray(logits)).all())}
        log(f"prefill T={T}: {T / sec:.0f} tokens/s")

    # 3. profile: the MLA attention alone, the bytes a step reads, a read bandwidth and the floor it implies
    # bytes of one token's MLA cache entries, all MLA layers together (c_kv + k_rope)
    mla_row_bytes = cfg.num_mla_layers * sum(x.dtype.itemsize * x.shape[-1] for _, x in _mla_leaves(cfg, run_cfg))
    bw = _read_bandwidth(max(batches) * c16k * mla_row_bytes, reps=5)
    profile = {"read_bandwidth_gb_per_s": bw / 1e9, "mla_cache_bytes_per_token_all_layers": mla_row_bytes,
               "param_bytes": param_bytes, "compiled": hlo, "per_batch": {}}
    for B in batches:
        per = {}
        for c in contexts:
            att = _attention_alone(cfg, run_cfg, B, tight[c], c, reps=3)
            per[f"ctx{c}"] = {"mla_attention_s": att, "step_s": t(f"B{B}_ctx{c}"),
                              "mla_attention_share_of_step": att / t(f"B{B}_ctx{c}"),
                              "mla_cache_bytes_read": B * c * mla_row_bytes}
        extra = B * (c16k - c1k) * mla_row_bytes
        per["floor_16k_over_1k_at_read_bandwidth"] = (t(f"B{B}_ctx{c1k}") + extra / bw) / t(f"B{B}_ctx{c1k}")
        touched = weight_bytes_touched(params, cfg, B)
        per["weight_bytes_touched"] = touched
        per["bytes_floor_16k_over_1k"] = {
            w: (wb + B * c16k * mla_row_bytes) / (wb + B * c1k * mla_row_bytes)
            for w, wb in (("all_weights", param_bytes), ("touched_weights", touched))}
        profile["per_batch"][f"B{B}"] = per
        log(f"B={B}: " + ", ".join(f"{k} attention {v['mla_attention_s'] * 1e3:.1f} ms of {v['step_s'] * 1e3:.1f}"
                                    for k, v in per.items() if k.startswith("ctx")))

    # 4. ratios and targets
    ratios = {}
    for B in batches:
        ratios[f"decode_time_16k_over_1k_b{B}"] = t(f"B{B}_ctx{c16k}") / t(f"B{B}_ctx{c1k}")
        ratios[f"decode_time_64k_over_1k_b{B}"] = t(f"B{B}_ctx{c64k}") / t(f"B{B}_ctx{c1k}")
        ratios[f"decode_time_1k_in_64k_cache_over_1k_cache_b{B}"] = (t(f"B{B}_ctx{c1k}_in_{big}_cache")
                                                                     / t(f"B{B}_ctx{c1k}"))
        ratios[f"absorbed_over_materialized_16k_b{B}"] = (t(f"B{B}_ctx{c16k}")
                                                          / t(f"B{B}_ctx{c16k}_materialized"))
    Bmax = max(batches)
    ratios["decode_time_16k_over_1k"] = ratios[f"decode_time_16k_over_1k_b{Bmax}"]
    ratios["decode_time_1k_in_64k_cache_over_1k_cache"] = max(
        ratios[f"decode_time_1k_in_64k_cache_over_1k_cache_b{B}"] for B in batches)
    ratios["absorbed_over_materialized_16k"] = ratios[f"absorbed_over_materialized_16k_b{Bmax}"]
    checks = {k: {"value": ratios[k], "target_max": v, "ok": bool(ratios[k] <= v)} for k, v in TARGETS.items()}
    floor = profile["per_batch"][f"B{Bmax}"]["bytes_floor_16k_over_1k"]["all_weights"]
    checks["decode_time_16k_over_1k"] |= {"bytes_floor": floor, "target_below_bytes_floor": bool(floor > TARGETS[
        "decode_time_16k_over_1k"])}
    finite = all(d["logits_finite"] for d in [*decode.values(), *prefill_out.values()])
    wall = time.perf_counter() - t_start
    log(f"done in {wall:.0f}s: " + ", ".join(f"{k} {c['value']:.2f} (<= {c['target_max']})"
                                            for k, c in checks.items()))
    return {
        "name": "decode",
        "config": {"preset": cfg.name, "params": n_params, "dtype": run_cfg.compute_dtype,
                   "mla_block_size": run_cfg.mla_block_size, "contexts": contexts, "batches": batches,
                   "prefill_lengths": sorted(set(args.prefill)), "rounds": args.rounds, "steps": args.steps,
                   "ratio_contexts": {"1k": c1k, "16k": c16k, "64k": c64k}, "cache_fill": "synthetic",
                   "timed": "compiled cache._extend (donated, last_only): the program decode_step(donate=True) "
                            "runs, without its host-side input checks",
                   "backend": jax.default_backend(), "devices": jax.device_count(), "jax": jax.__version__},
        "headline": {"decode_time_16k_over_1k": f"batch {Bmax} (the largest)",
                     "decode_time_1k_in_64k_cache_over_1k_cache": "max over batches",
                     "absorbed_over_materialized_16k": f"batch {Bmax} (the largest)"},
        "decode": decode,
        "prefill": prefill_out,
        "profile": profile,
        "ratios": ratios,
        "targets": TARGETS,
        "checks": checks,
        "logits_finite": finite,
        "ok": all(c["ok"] for c in checks.values()) and finite,
        "wall_s": wall,
    }


def weight_bytes_touched(params, cfg, batch: int) -> int:
    """Parameter bytes one decode step of ``batch`` rows reads: every leaf in full except the routed expert stacks,
    of which the expected distinct experts under uniform top-k routing, E (1 - (1 - k/E)^B) per layer (k of them at
    B = 1; the input embedding is counted in full, an over-estimate of B rows)."""
    E, k = cfg.num_experts, cfg.num_experts_per_token
    frac = 1.0 - (1.0 - k / E) ** batch if E else 0.0
    total = 0.0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        n = x.size * x.dtype.itemsize
        total += n * frac if "'experts'" in jax.tree_util.keystr(path) else n
    return int(total)


def _mla_leaves(cfg, run):
    """(name, ShapeDtypeStruct) of one MLA layer's cache, one token per row."""
    return list(layer_cache_shapes(cfg, cfg.mla_layers[0], 1, 1, run).items())


__all__ = ["TARGETS", "add_arguments", "cache_sized_ops", "run", "synthetic_cache", "weight_bytes_touched"]
