"""Runnable examples: `python -m flexdma.examples.mqar`."""
