"""Benchmark suite of triattn-cupy: see run.py and NOTES.md."""
