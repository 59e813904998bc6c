"""Dimension legend used in einsum equations, array names and docstrings (docs/design.md §3.5).

Einsums are lower case, docstrings upper case. Top-k is ``A`` so it never collides with ``K``.

    B batch                T query positions          S key/value positions
    D model width (d)      F FFN / expert hidden      N query heads (MLA) / heads (KDA)
    K key head dim (KDA)   V value head dim           H head dim (MLA q/k: nope + rope slice)
    L layers               W vocabulary               E routed experts
    A active experts / tok C chunk (KDA) / capacity   R low-rank latent (MLA q/kv LoRA, KDA f_a / g_a)
    P LatentMoE latent     M grouped-matmul rows (token-slots sorted by expert)
    G stacked layer groups (k3jax/model/layout.py)   Wc short-conv taps (KDA)   X conv channels (N*K, head-major)

Logical axis names (consumed by the sharding rules table; a layer attaches them to its parameters):
"""

# Logical axis names attached to parameters and activations. sharding/rules.py maps them to mesh axes; an
# unknown name is an error there, never silently replicated.
LOGICAL_AXES = (
    "batch",
    "seq",
    "embed",  # model width d
    "vocab",
    "heads",  # attention heads (KDA and MLA)
    "head_dim",  # per-head channel (KDA K/V, MLA nope/rope/v)
    "q_lora",  # MLA q latent
    "kv_lora",  # MLA kv latent (+ shared rope slice)
    "kda_rank",  # KDA f_a / low-rank gate rank
    "conv_tap",  # KDA short conv taps
    "mlp",  # dense / shared-expert hidden
    "experts",  # routed experts
    "expert_mlp",  # routed expert hidden f
    "latent",  # LatentMoE latent width
    "norm",  # norm gains and 1-D vectors that are never sharded (the QB router bias [E] too)
    "layers",  # the stacked axis of the repeating layer group (k3jax/model/layout.py)
    "lora_rank",  # a LoRA adapter's rank r (k3jax/layers/lora.py): never sharded
)
