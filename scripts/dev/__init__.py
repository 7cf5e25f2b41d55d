"""Timing scripts for kernel development: quick same-run comparisons of builds, option sweeps and
profiles (the benchmark suite proper is `python -m benchmarks`). Each runs from the repository root
as a module, `python -m scripts.dev.<name>` (e.g. `python -m scripts.dev.cuda_dev --out results.json`),
with flexdma installed; each module's docstring gives its arguments. They may import the suite
(`benchmarks`), never the other way round: the suite stands alone."""
