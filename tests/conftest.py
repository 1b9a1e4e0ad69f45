import os
import zlib

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per xdist worker: `-n 2` on 2 cores with 2 threads each oversubscribes
    # (measured: twice the CPU time for the same tests)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs per case (a different seed per test id), reproducible across runs."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


# ---- GPU tests: the markers' skip rule lives in tests/markers.py (importable by tests by name:
# with tests_dist collected too, "conftest" may name tests_dist's)


from markers import gpu_skip_reason  # noqa: E402


def pytest_runtest_setup(item):
    reason = gpu_skip_reason(item)
    if reason:
        pytest.skip(reason)
