"""The product's benchmarks, run from the repository root: `python -m benchmarks.throughput` etc."""
