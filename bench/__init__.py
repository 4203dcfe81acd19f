"""The benchmark on full-size architectures (bench/bench.py) and its results (bench/RESULTS.md)."""
