"""Worker for test_multihost.py: one of 2 local CPU processes (4 devices each) running an EP forward + backward
on a 2 × 4 (data × expert) mesh whose expert axis spans both processes. Writes its results to OUTDIR/proc{i}.npz.

    python tests/sharding/ep_multihost_worker.py PROCESS_ID PORT OUTDIR
"""

import os
import sys

import numpy as np

M, A, E, P, F = 64, 2, 8, 16, 12


def problem():
    """A skewed routing in NumPy (identical in every process and in the test)."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=(M, P)).astype(np.float32)
    w1 = (0.3 * rng.normal(size=(E, P, F))).astype(np.float32)
    w3 = (0.3 * rng.normal(size=(E, P, F))).astype(np.float32)
    w2 = (0.3 * rng.normal(size=(E, F, P))).astype(np.float32)
    other = rng.integers(0, E - 1, size=M)
    ids = np.stack([np.full(M, 5), np.where(other >= 5, other + 1, other)], axis=1).astype(np.int32)
    wts = rng.dirichlet(np.ones(A), size=M).astype(np.float32)
    return z, ids, wts, w1, w3, w2


def loss_fn(experts_fn, act):
    import jax.numpy as jnp

    def loss(z, ids, wts, w1, w3, w2):
        y = experts_fn(z, ids, wts, w1, w3, w2, act)
        return jnp.sum(jnp.sin(y)), y

    return loss


def main(pid: int, port: int, outdir: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=60)
    from functools import partial

    from jax.sharding import NamedSharding, PartitionSpec

    from k3jax.ops.activations import glu_activation
    from k3jax.sharding.expert_parallel import ExpertParallel
    from k3jax.sharding.mesh import make_mesh

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    # expert row r = [p0 d(2r), p1 d(2r), p0 d(2r+1), p1 d(2r+1)]: every all_to_all crosses the process boundary
    order = [devs[4 * p + 2 * r + j] for r in range(2) for j in range(2) for p in range(2)]
    mesh = make_mesh({"data": 2, "expert": 4}, devices=order)
    rep = NamedSharding(mesh, PartitionSpec())
    args = [jax.make_array_from_callback(x.shape, rep, lambda idx, x=x: x[idx]) for x in problem()]
    act = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
    ep = ExpertParallel(mesh, "ep")
    fn = jax.jit(jax.value_and_grad(loss_fn(ep, act), argnums=(0, 2, 3, 4, 5), has_aux=True), out_shardings=rep)
    (loss, y), grads = fn(*args)
    out = {"loss": np.asarray(loss), "y": np.asarray(y)}
    out.update({f"g{i}": np.asarray(g) for i, g in enumerate(grads)})
    np.savez(os.path.join(outdir, f"proc{pid}.npz"), **out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
