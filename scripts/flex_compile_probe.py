"""Which small packed geometries flex_attention cannot compile on this GPU with inductor's own
kernel choice (kernel_options {}), and whether forcing flex's main (non-decoding) kernel, the
library's default below 128 rows, compiles them: each case forward + backward through FlexKernel
with segments=, in its own process (a failed compile leaves inductor state behind). Prints one
line per case and writes flex_compile_probe.json under $OUT (or the current folder).

    python scripts/flex_compile_probe.py
"""
import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GEOMETRIES = {   # (cu_q, cu_k, window)
    "60x60-causal-docs": ((0, 1, 5, 21, 22, 60), (0, 1, 5, 21, 22, 60), (None, 0)),
    "33x52-left-bounded": ((0, 7, 33), (0, 19, 52), (5, None)),
    "60x60-one-doc": ((0, 60), (0, 60), (None, 0)),
    "256x256-docs": ((0, 100, 256), (0, 100, 256), (None, 0)),
}


def one(case):
    geom, d, (hq, hkv), force = case
    import torch
    from cp_softcap.kernels.flex import FlexKernel
    cu_q, cu_k, window = GEOMETRIES[geom]
    kern = FlexKernel(kernel_options={"FORCE_USE_FLEX_ATTENTION": True} if force else {})
    torch.manual_seed(0)
    q = torch.randn(1, cu_q[-1], hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, cu_k[-1], hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    segs = (cu_q, cu_k) if len(cu_q) > 2 else None
    try:
        out, lse = kern.forward(q, k, v, scale=d ** -0.5, softcap=30.0, window=window, segments=segs)
        kern.backward(torch.randn_like(q), q, k, v, out, lse, scale=d ** -0.5, softcap=30.0,
                      window=window, segments=segs)
        torch.cuda.synchronize()
        return dict(geometry=geom, d=d, hq=hq, hkv=hkv, force=force, ok=True)
    except Exception as e:
        return dict(geometry=geom, d=d, hq=hq, hkv=hkv, force=force, ok=False,
                    error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")


def main():
    import multiprocessing as mp
    cases = list(itertools.product(GEOMETRIES, (16, 64), ((4, 1), (4, 4)), (False, True)))
    with ProcessPoolExecutor(8, mp_context=mp.get_context("spawn")) as ex:
        res = list(ex.map(one, cases))
    for r in res:
        print(f"{r['geometry']:<20} d={r['d']:<3} {r['hq']}/{r['hkv']} force={int(r['force'])} "
              f"{'ok' if r['ok'] else 'FAIL ' + r['error']}")
    path = os.path.join(os.environ.get("OUT", "."), "flex_compile_probe.json")
    import torch                        # after the workers: they spawn their own CUDA contexts
    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name(),
                question="does flex compile small packed geometries with inductor's own choice "
                         "(force=False) and with the main kernel forced (force=True)?")
    with open(path, "w") as f:          # {meta, records}, as every file in benchmarks/results/
        json.dump(dict(meta=meta, records=res), f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
