"""The GPU markers' skip rule (tests/conftest.py) on this CPU machine, with the GPU facts it
reads replaced: each marker skips with its own reason, and a test runs where everything is met."""
import pytest
import torch
import torch.distributed
from markers import _kernel_reason, gpu_skip_reason


class _Item:
    def __init__(self, *marks):
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name=None):
        return (m for m in self.marks if name is None or m.name == name)


@pytest.fixture
def gpus(monkeypatch):
    def have(n, probe=lambda name, spec: None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)

        class Stub:
            def __init__(self, name):
                self.name = name

            def probe(self, spec):
                return probe(self.name, spec)
        monkeypatch.setattr("cp_softcap.kernels.get_kernel", Stub)
        _kernel_reason.cache_clear()
    yield have
    _kernel_reason.cache_clear()


def test_unmarked_tests_are_left_alone(gpus):
    gpus(0)
    assert gpu_skip_reason(_Item(pytest.mark.slow)) is None


def test_no_gpu(gpus):
    gpus(0)
    assert "needs a CUDA GPU" in gpu_skip_reason(_Item(pytest.mark.gpu))
    assert "needs a CUDA GPU" in gpu_skip_reason(_Item(pytest.mark.fa4))


def test_gpu_count(gpus):
    gpus(1)
    item = _Item(pytest.mark.gpu, pytest.mark.nccl, pytest.mark.multi_gpu(4))
    assert gpu_skip_reason(item) == "needs 4 GPUs (one rank per GPU), this machine has 1"
    gpus(4)
    assert gpu_skip_reason(item) is None


def test_kernel_probe_reason_and_marker_spec(gpus):
    seen = []

    def probe(name, spec):
        seen.append((name, spec.documents))
        return "flash-attn-4 not importable" if name == "fa4" else None
    gpus(1, probe)
    assert gpu_skip_reason(_Item(pytest.mark.gpu, pytest.mark.fa4)) == "fa4: flash-attn-4 not importable"
    assert gpu_skip_reason(_Item(pytest.mark.gpu, pytest.mark.fa2(documents=True))) is None
    assert ("fa2", True) in seen
