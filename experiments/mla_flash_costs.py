"""The MLA flash kernel's declared costs at K3's sizes, as XLA sees them: the forward and the two Pallas backward
kernels (``mla_flash_dq``, ``mla_flash_dkv``) of one layer's VJP over one T = S = 4096 sequence, 96 heads, fp32 q and
k_rope (the model's attention dtype), bf16 latent and up-projections, compiled for one deviceless v5p chip. Prints
the compiled program's cost analysis and each kernel's ``cost_estimate`` (flops, bytes) from the HLO.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu .venv/bin/python experiments/mla_flash_costs.py
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

from pallas_kernels.mla import mla_flash

B, T, N, HN, HR, V, R = 1, 4096, 96, 128, 64, 128, 512


def main() -> None:
    topo = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    args = [sds((B, T, N, HN + HR), jnp.float32), sds((B, T, R), jnp.bfloat16), sds((B, T, HR), jnp.float32),
            sds((R, N, HN), jnp.bfloat16), sds((R, N, V), jnp.bfloat16), sds((B, T, N, V), jnp.float32)]

    def vjp(q, c, r, wk, wv, do):
        _, f = jax.vjp(lambda *a: mla_flash(*a, scale=(HN + HR) ** -0.5, block_k=512, platform="tpu")[0],
                       q, c, r, wk, wv)
        return f(do)

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(vjp).lower(*args).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    print(f"program: {ca['flops'] / 1e12:.3f} TFLOP, {ca['bytes accessed'] / 1e9:.2f} GB")
    for line in compiled.as_text().splitlines():          # one Mosaic custom call per line: its name and estimate
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        name = re.search(r"mla_flash_\w+", line)
        est = re.search(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"', line)
        if name and est:
            flops, nbytes = int(est.group(1)), int(est.group(2))
            print(f"{name.group(0).rstrip('_')}: {flops / 1e12:.3f} TFLOP, {nbytes / 1e9:.2f} GB")

if __name__ == "__main__":
    main()
