import os
import zlib

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per xdist worker: `-n 2` on 2 cores with 2 threads each oversubscribes
    # (measured: twice the CPU time for the same tests)
    torch.set_num_threads(1)


# The files whose tests took longest in CI (2 cores, -n 2; multi-process launches, compiles,
# timeouts). pytest-xdist hands tests out in collection order, so these go first: otherwise one
# worker ran them alone at the end while the other had nothing left.
FIRST = ("test_benchmarks_runner.py", "test_hf_trainer_dist.py", "test_readme.py",
         "test_trl_sft_dist.py", "test_gemma2_train.py", "test_hf_models_cp.py",
         "test_gemma2_memory.py", "test_onnx.py", "test_bad_inputs_dist.py",
         "test_exit_after_timeout.py", "test_robustness.py", "test_compile_dist.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))     # stable: order kept within


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


@pytest.fixture(scope="module")
def gloo_group_of_one():
    """torch.distributed initialised in this process as one gloo rank (file rendezvous in a
    temporary folder) for the tests of one module; its WORLD group."""
    import tempfile
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rdzv')}",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
