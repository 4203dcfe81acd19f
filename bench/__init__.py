"""The benchmark on full-size architectures (bench/bench.py) and its results (docs/performance.md; `bench.py report` writes the full report)."""
