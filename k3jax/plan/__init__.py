"""Planning a model on hardware before running it: what it costs, in closed form and as the compiler sees it.

    formula.py   `k3 plan`: parameters, checkpoint bytes, per-device memory and caches from the config's shapes
    hardware.py  published figures of the GPUs and TPU chips plans are made for; compile targets; the roofline
    spec.py      what a compiled plan is asked for (mode, mesh, batch, sequence), its defaults and input checks
    estimate.py  closed-form argument bytes, Newton–Schulz and step FLOPs of a plan
    aot.py       `k3 plan --compile`: the full-size program lowered and compiled for a TPU topology or cpu:N
    verify.py    `--mode verify`: one speculative step (target verify + rollback + the draft's next proposal)
    hlo.py       the compiled program's HLO text as computations, and how often each runs (loop trip counts)
    hlo_cost.py  what it costs: FLOPs, HBM bytes (weights / activations / kernels / collectives), collectives and
                 custom calls (a kernel charged its declared cost estimate), named scopes' FLOPs and collectives
    hlo_bytes.py the HBM bytes one instruction reads and writes, and which values are views of the arguments
    floor.py     what a step cannot go below: its collectives' fixed latency (launch + ICI hops) and the bytes it
                 must touch (weights given batch and routing, caches, inputs / outputs once)

It sits above ``k3jax.train`` (a train plan compiles the train step) and below ``k3jax.cli`` (``cli/plan.py`` only
parses flags and prints).
"""
