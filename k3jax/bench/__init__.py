"""Benchmarks behind `k3 bench NAME` (one module per benchmark)."""
