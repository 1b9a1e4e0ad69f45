"""Bytes sent per rank per layer for PACKED streams: the byte model (cp_softcap/comm_model.py with
documents=, checked equal to counted bytes by tests_dist/test_packed_cp.py) on the document mixes
of benchmarks/packing_balance.py. Host arithmetic only (no kernels, no GPU).

    python benchmarks/packed_bytes.py                # 128K stream, cp 4/8, Gemma2-9B shapes
    python benchmarks/packed_bytes.py --dry-run      # 8K stream, cp 4: a check of the script

Per (mix, cp, window): MiB sent by the busiest rank, forward + backward, on the default
(causal-balanced) packed layout, for the ring (only same-document visible keys travel),
all_gather, a2a, a2a+p2p with a2a groups of 2, and what comm="auto" picks; for comparison, the
ring of an UNPACKED call on a stream of the same length (zigzag, one document), and the ring on
the layout balanced for both Gemma2 layer kinds (layer_windows=[None, (4095, 0)]). Partials: float32 dK/dV (the torch
kernel) and bf16 (the flash-attn family: caps.grads_in_input_dtype).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._util import OUT_DIR_HELP, out_dir_for, save, table  # noqa: E402
from benchmarks.packing_balance import mix  # noqa: E402
from cp_softcap.comm_model import bytes_per_rank, choose_comm  # noqa: E402
from cp_softcap.documents import packed_layout  # noqa: E402
from cp_softcap.settings import ring_block_keys  # noqa: E402
from cp_softcap.spec import make_spec  # noqa: E402

MIB = 2 ** 20
WINDOWS = {"causal": None, "(4095, 0)": (4095, 0)}


def measure(kind: str, total: int, cp: int, window_name: str, partial_bytes):
    cu = mix(kind, total, 0)
    window = WINDOWS[window_name]
    layout = packed_layout(cu, total, cp)          # the default layout: balanced for causal
    spec = make_spec(head_dim=256, num_heads=16, num_kv_heads=8, dtype=torch.bfloat16,
                     device_type="cuda", softcap=50.0, causal=True, window=window, cp_size=cp,
                     documents=True)
    kw = dict(partial_bytes=partial_bytes, block_keys=ring_block_keys())
    packed = bytes_per_rank(spec, layout.seq_len, a2a_size=2, documents=layout, **kw)
    unaware = bytes_per_rank(spec, layout.seq_len, a2a_size=2, **kw)["ring"]
    joint = packed_layout(cu, total, cp, layer_windows=[None, (4095, 0)])
    ring_joint = bytes_per_rank(spec, joint.seq_len, documents=joint, **kw)["ring"]
    pick = choose_comm(spec, layout.seq_len, documents=layout, **kw)
    return {"mix": kind, "cp": cp, "window": window_name, "docs": len(cu) - 1, "tokens": total,
            "partials": "float32" if partial_bytes is None else "bf16",
            **{f"{k}_mib": v / MIB for k, v in packed.items()}, "ring_zigzag_mib": unaware / MIB,
            "ring_joint_mib": ring_joint / MIB,
            "auto": pick}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="8K stream, cp 4 (a check of the script)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = p.parse_args(argv)
    total, cps = (8192, (4,)) if args.dry_run else (131072, (4, 8))
    records = [measure(kind, total, cp, w, pb)
               for pb in (None, 2) for kind in ("long-tail", "long-tail+pad", "short", "single")
               for cp in cps for w in WINDOWS]
    head = ["partials", "mix", "cp", "window", "ring packed", "ring, joint layout", "ring unpacked (zigzag)",
            "all_gather", "a2a", "a2a+p2p (2)", "auto picks"]
    rows = [head] + [[r["partials"], r["mix"], r["cp"], r["window"], f"{r['ring_mib']:.1f}",
                      f"{r['ring_joint_mib']:.1f}", f"{r['ring_zigzag_mib']:.1f}",
                      f"{r['all_gather_mib']:.1f}", f"{r['a2a_mib']:.1f}",
                      f"{r['a2a+p2p_mib']:.1f}", r["auto"]] for r in records]
    print(table(rows))
    out = out_dir_for(args.out_dir, args.dry_run)
    print(save("packed_bytes", records, {"tokens": total, "shapes": "Gemma2-9B: Hq 16, Hkv 8, D 256, bf16",
                                         "dry_run": args.dry_run, "seed": 0}, out))


if __name__ == "__main__":
    main()
