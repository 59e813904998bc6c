"""The K3 network as Flax NNX modules (network.py, decoder.py; the residual stream a layer carries, residual.py), its
stacked layout (layout.py), the functional face over the parameter state (functional.py) and its parameter counts
(counts.py)."""

from k3jax.model.counts import active_params, count_params
from k3jax.model.functional import (
    abstract_model,
    abstract_params,
    forward,
    graphdef,
    hidden_states,
    init_params,
    lm_loss,
    merge,
    mla_dims,
    param_axes,
)
from k3jax.model.layout import (
    Layout,
    gather_layers,
    layer_kind,
    layer_view,
    layout,
    leaf_location,
    map_layers,
    restack,
    unstack,
)
from k3jax.model.network import K3Model

__all__ = ["K3Model", "Layout", "abstract_model", "abstract_params", "active_params", "count_params", "forward",
           "gather_layers", "graphdef", "hidden_states", "init_params", "layer_kind", "layer_view", "layout",
           "leaf_location", "lm_loss", "map_layers", "merge", "mla_dims", "param_axes", "restack", "unstack"]
