"""How the transport waits: bounded and blocking on gloo and for host reads; stream-ordered
(no timeout argument, which would block the host thread) for CUDA tensors over NCCL; every
failure re-raised naming the op and the rank. One gloo process; the NCCL branch is chosen by
patching the device test, since the decision, not NCCL itself, is what is checked here."""
from datetime import timedelta

import pytest
import torch

from cp_softcap import transport


@pytest.fixture(scope="module")
def group(gloo_group_of_one):
    return gloo_group_of_one


class FakeWork:
    def __init__(self, fail=None, done=True):
        self.calls, self.fail, self.done = [], fail, done

    def wait(self, *args):
        self.calls.append(args)
        if self.fail:
            raise RuntimeError(self.fail)
        return self.done


def test_gloo_waits_are_bounded(group, monkeypatch):
    monkeypatch.setenv("CP_SOFTCAP_TIMEOUT", "7")
    work = FakeWork()
    transport.wait(work, "ring.fwd.kv", group, torch.zeros(1))
    assert work.calls == [(timedelta(seconds=7),)]
    with pytest.raises(RuntimeError, match=r"ring.fwd.kv on CP rank 0 .* timed out after 7s"):
        transport.wait(FakeWork(done=False), "ring.fwd.kv", group, torch.zeros(1))


def test_device_waits_only_order_the_stream(group, monkeypatch):
    monkeypatch.setattr(transport, "stream_ordered", lambda g, t: True)
    work = FakeWork()
    transport.wait(work, "ring.fwd.kv", group, torch.zeros(1))
    assert work.calls == [()], "a timeout argument makes NCCL block the host thread"
    with pytest.raises(RuntimeError, match=r"a2a.fwd.q on CP rank 0 .*process group's timeout.*"
                                           r"watchdog: collective timed out"):
        transport.wait(FakeWork(fail="watchdog: collective timed out"), "a2a.fwd.q", group,
                       torch.zeros(1))


def test_host_reads_stay_bounded_on_device(group, monkeypatch):
    monkeypatch.setenv("CP_SOFTCAP_TIMEOUT", "5")
    monkeypatch.setattr(transport, "stream_ordered", lambda g, t: True)
    work = FakeWork()
    transport.wait(work, "the CP per-call check", group, torch.zeros(1), host=True)
    assert work.calls == [(timedelta(seconds=5),)]


def test_exchange_decides_from_its_tensors(group, monkeypatch):
    seen = []
    monkeypatch.setattr(transport, "stream_ordered", lambda g, t: seen.append(t) or True)
    y = torch.empty(4)
    ex = transport.Exchange(group, "ring.fwd.kv").recv(y, 0)
    ex.ops, ex.works = [], [FakeWork()]       # posted and answered without a peer
    work = ex.works[0]
    ex.wait()
    assert seen == [y] and work.calls == [()]


def test_stream_ordered_is_false_on_cpu(group):
    assert not transport.stream_ordered(group, torch.zeros(1))
