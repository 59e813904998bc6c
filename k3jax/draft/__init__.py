"""Speculative decoding with a DSpark-style draft: the draft's config (``config``), its network (``network``) and
its files in the published layout (``io``)."""

from k3jax.draft.config import DraftConfig, DraftMismatchError, check_target, target_hash
from k3jax.draft.io import draft_tensor_shapes, load_draft, save_draft
from k3jax.draft.network import DraftModel, draft_cache

__all__ = ["DraftConfig", "DraftMismatchError", "DraftModel", "check_target", "draft_cache", "draft_tensor_shapes",
           "load_draft", "save_draft", "target_hash"]
