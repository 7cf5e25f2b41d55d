"""Shared pytest setup: a fresh, reproducible seed per test and the `gpu` marker."""

import zlib

import pytest
import torch

from flexdma import _dispatch


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    # Seeded from the test id: every test gets its own inputs, and a failure reruns identically.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    # Plans are kept by call signature (flexdma/_dispatch.py); tests that patch what the plan reads
    # (the extension's state, the kernels' checks) start from none.
    _dispatch._PLANS.clear()
    yield


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
