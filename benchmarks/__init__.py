"""Benchmark suite of triattn-cupy: see run.py and docs/performance.md."""
