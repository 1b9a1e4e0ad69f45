"""examples/gemma2/train.py with deterministic algorithms on and an optional injected fault, for
tests_dist/test_faults.py. Run under torchrun exactly like train.py:

    CP_SOFTCAP_FAULT=after_save:4:3 CP_SOFTCAP_FAULT_DIR=/tmp/f \
        python -m torch.distributed.run ... tests_dist/fault_train.py <train.py args>

CP_SOFTCAP_FAULT = "<where>:<step>:<rank>", only in the first attempt (TORCHELASTIC_RESTART_COUNT
0); later attempts run clean:
    after_save  rank <rank> finishes checkpoint.save of step <step> (marker written, all ranks
                past the final barrier), then stops and waits to be killed
    in_save     rank <rank> finishes its part of DCP's save of step <step> (data files and
                .metadata on disk, COMPLETE marker not yet written), then stops and waits
The waiting rank writes its pid to <FAULT_DIR>/victim.pid; the test SIGKILLs that pid from
outside. A victim nobody kills exits with code 3 after 120 s (never hangs a test).
"""
from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def _stop_and_wait(fault_dir: str, what: str) -> None:
    tmp = os.path.join(fault_dir, "victim.pid.tmp")
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {what}\n")
    os.replace(tmp, os.path.join(fault_dir, "victim.pid"))
    print(f"FAULT: {what}; pid {os.getpid()} waits to be killed", flush=True)
    time.sleep(120)
    os._exit(3)


def install_fault(spec: str, fault_dir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from gemma2 import checkpoint

    where, step, rank = spec.split(":")
    step, rank = int(step), int(rank)
    if where == "after_save":
        real_save = checkpoint.save

        def save(ckpt_dir, at, *args, **kw):
            path = real_save(ckpt_dir, at, *args, **kw)
            if at == step and dist.get_rank() == rank:
                _stop_and_wait(fault_dir, f"rank {rank} after saving step {at}")
            return path
        checkpoint.save = save
    elif where == "in_save":
        real_dcp_save = dcp.save

        def dcp_save(state, *args, checkpoint_id=None, **kw):
            result = real_dcp_save(state, *args, checkpoint_id=checkpoint_id, **kw)
            if os.path.basename(str(checkpoint_id)) == f"step-{step}" and dist.get_rank() == rank:
                _stop_and_wait(fault_dir, f"rank {rank} inside the save of step {step}, before its marker")
            return result
        dcp.save = dcp_save
    else:
        raise SystemExit(f"unknown CP_SOFTCAP_FAULT {spec!r}")


def main() -> None:
    torch.use_deterministic_algorithms(True)
    spec = os.environ.get("CP_SOFTCAP_FAULT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        install_fault(spec, os.environ["CP_SOFTCAP_FAULT_DIR"])
    from gemma2 import train
    train.main(sys.argv[1:])


if __name__ == "__main__":
    main()
