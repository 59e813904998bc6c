"""Per-part CPU cost of one speculative step on the shipped k3-mini (B = 1, 64-token context, K = 7, a random-init
draft): the draft's propose, with_records, the recorded verify extend (copy / replay), rollback, a plain 8-token
extend, one decode step. `.venv/bin/python experiments/draft/verify_cost.py` (figures: experiments/LOG.md, session 26)."""
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.checkpoint.source import default_ckpt, load_model
from k3jax.draft.config import DraftConfig
from k3jax.draft.network import DraftModel
from k3jax.draft.speculative import DSparkDrafter, accept_greedy
from k3jax.model.cache import decode_step, extend, init_cache
from k3jax.model.generate import Sampling
from k3jax.model.rollback import rollback, with_records

cfg, run, params = load_model(ckpt=default_ckpt(), preset=None)
dcfg = DraftConfig.for_target(cfg); d = DSparkDrafter(DraftModel(dcfg, rngs=nnx.Rngs(0)), dcfg, params, cfg, run, K=7)
B=1; prompt = np.arange(64, dtype=np.int32)[None] % cfg.vocab_size
cache = init_cache(cfg, B, 256, run)
logits, cache, taps = extend(params, prompt, None, cache, cfg, run, last_only=True, taps=d.taps)
st = d.start(taps, np.array([64]), 256)
anchor = np.array([5], np.int32)
def T(f, n=5):
    f(); t=time.perf_counter()
    for _ in range(n): r=f()
    jax.block_until_ready(r); return (time.perf_counter()-t)/n*1e3
key=jax.random.key(0); s=Sampling()
ids,_ = d.propose(st, anchor, key, s)
print("propose ms", T(lambda: d.propose(st, anchor, key, s)[0]))
piece = np.concatenate([anchor[:,None], np.asarray(ids)],1)
for mode in ("copy","replay"):
    rc = with_records(cache, cfg, 8, mode)
    print(mode, "with_records ms", T(lambda: jax.tree.leaves(with_records(cache, cfg, 8, mode))))
    print(mode, "verify extend ms", T(lambda: extend(params, piece, None, rc, cfg, run, absorbed=True, taps=d.taps)[0]))
    vl, vc, vt = extend(params, piece, None, rc, cfg, run, absorbed=True, taps=d.taps)
    print(mode, "rollback ms", T(lambda: rollback(vc, cfg, np.array([3],np.int32), start=np.array([64],np.int32))["lengths"]))
print("plain extend 8 (no records) ms", T(lambda: extend(params, piece, None, cache, cfg, run, absorbed=True)[0]))
print("decode step ms", T(lambda: decode_step(params, anchor, cache, cfg, run)[0]))
print("accept ms", T(lambda: accept_greedy(vl, jnp.asarray(piece[:,1:]))[0]))
print("draft accept ms", T(lambda: d.accept(st, vt, np.array([3],np.int32))["lengths"]))
