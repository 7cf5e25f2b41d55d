"""flexdma's benchmark suite: `python -m benchmarks <subcommand>` (see benchmarks/cli.py)."""
