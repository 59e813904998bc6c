"""Benchmarks behind `k3 bench NAME` (one module per benchmark: kda, mxfp4, moe, load, train), and the GPU check +
benchmark scripts of the Pallas kernels: `python -m k3jax.bench.gpu_kda`, `python -m k3jax.bench.gpu_mxfp4`."""
