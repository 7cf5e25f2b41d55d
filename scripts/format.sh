#!/usr/bin/env bash
# Formats the whole tree once (Python with ruff, C++ / CUDA with clang-format) and ends the
# format-pending exclusions of the lint check: see scripts/lint.sh.
exec bash "$(dirname "$0")/lint.sh" format
