"""A rank whose peer stalls gets the library's timeout error AND can exit: on gloo a collective
runs on the group's worker thread until the op's own timeout (the group's, 30 min by default)
and the process cannot end before it, so the library gives each gloo collective the wait's
timeout. Real processes (not the test harness's, which end with os._exit and so never wait
for gloo at exit)."""
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = r"""
import sys, time, torch, torch.distributed as dist
import cp_softcap as cps
rank, init = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
q = torch.randn(1, 8, 2, 8)
cps.cp_attention(q, q, q, dist.group.WORLD, softcap=30.0, comm="all_gather")   # both ranks
if rank == 1:
    time.sleep(60)                      # stalls: never makes the second call
else:
    try:
        cps.cp_attention(q, q, q, dist.group.WORLD, softcap=30.0, comm="all_gather")
    except RuntimeError as e:
        print("ERROR", str(e)[:60], flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_rank_exits_soon_after_its_timeout_error(tmp_path):
    env = {**os.environ, "CP_SOFTCAP_TIMEOUT": "2", "PYTHONPATH": ROOT}
    init = str(tmp_path / "rendezvous")
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), init], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        start = time.monotonic()
        out, _ = ranks[0].communicate(timeout=45)
        took = time.monotonic() - start
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert "ERROR cp_softcap:" in out, out
    assert ranks[0].returncode == 0, out
    assert took < 30, f"rank 0 exited {took:.0f}s after start, with its peer still stalled:\n{out}"
