"""k3jax.optim — what updates the parameters of a training run, and the settings that configure it (docs/model.md
§8–§9; docs/design.md §2). Below sharding: it imports the model (layer views, MLA dims), never a mesh's rules.

    optimizer.py  OptimConfig (learning rate and its schedule, Muon / AdamW settings), make_optimizer: the K3 split
                  of per-head / per-expert / full-matrix Muon and AdamW, one layer at a time over stacked groups
    dist_muon.py  owner-compute Muon on a mesh (--muon-layout owner): each block orthogonalized whole on one device
    qk_clip.py    QK-Clip (MuonClip): the per-head rescale of the MLA query / key weights after the update
    balance.py    expert-load balancing between steps: Quantile Balancing (K3), the sign rule, an auxiliary loss
    qb.py         Quantile Balancing's math: the integer r-histogram, the bias estimate from it, the exact reference

Import the modules (``from k3jax.optim.optimizer import OptimConfig``): this file re-exports nothing, so that a
module that needs one constant (``balance.MODES``) loads only that module's imports.
"""
