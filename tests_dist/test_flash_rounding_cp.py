"""The packed-CP check of tests/test_gpu_packed_cp.py (skipped without CUDA) on CPU/gloo, with a
stand-in that rounds as the bf16 flash kernels do (flash_standin.py): bf16 forward O, P and dS
rounded to bf16, per-call gradients in bf16.

Claim checked, per comm type: such a kernel meets 2x the bf16 'grad' tolerance against the
rounding-aware reference (float64 gradients of the loss with the returned O used in
D = rowsum(dO * O), as the GPU test holds fa4/flex to), and fails the bf16 'grad' tolerance
against the plain float64 gradients (negative control: the stand-in really rounds; the GPU test
saw dq/dk ~0.03 there). The boundaries-dropped control of the GPU test must fail by > 0.1.
"""
import pytest
import torch

from harness import run_ranks
from packed_cp_check import STANDIN, worker


def _check(world, comms, window):
    from cp_softcap.testing import TOLERANCES
    tol = TOLERANCES[torch.bfloat16]["grad"]
    reports = run_ranks(worker, world, STANDIN, torch.bfloat16, comms, window, timeout=240)
    for comm in comms:
        w = {key: max(r[comm][key] for r in reports) for key in reports[0][comm]}
        aware = max(w[g] for g in ("dq", "dk", "dv"))
        plain = max(w[g + "_exact"] for g in ("dq", "dk", "dv"))
        print(f"cp {world} {comm} window {window}: aware {aware:.4f} plain {plain:.4f} "
              f"out {w['out']:.4f} dropped {w['dropped']:.3g}")
        assert aware <= 2 * tol, (comm, w)          # check_against_reference already raised
        # every comm type, not only the ring: this is also what shows the stand-in served the call
        assert plain > tol, f"{comm}: plain-reference error {plain:.4f} <= {tol}: the stand-in does not round"
        assert w["dropped"] > 0.1, f"{comm}: the boundaries-dropped control is too weak ({w})"


def test_flash_rounding_packed_cp2():
    _check(2, ("ring", "all_gather", "a2a"), None)


@pytest.mark.slow      # cp 2 covers the claim for ring, all_gather and a2a
def test_flash_rounding_packed_cp4_window():
    _check(4, ("ring", "a2a+p2p"), (100, 0))
