"""Timing scripts for kernel development: quick same-run comparisons of builds, option sweeps and
profiles (the benchmark suite proper is `python -m benchmarks`). Run from the repository root, e.g.
`PYTHONPATH=. python3 -m scripts.dev.cuda_dev --out results.json`."""
