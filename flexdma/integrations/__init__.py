"""Adapters that plug flexdma into other libraries (optional dependencies, imported on demand)."""
