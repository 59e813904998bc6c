"""Float64 NumPy transcriptions of docs/model.md and docs/numerics.md (simple loops): the definitional oracles every
fast path is tested against. Nothing here is fast and nothing here imports jax numerics."""
