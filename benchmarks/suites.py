"""The suites of `python -m benchmarks`: each is a list of steps, and each step is one benchmark
module run with the arguments of a full run, a quick run (--quick: the figures RESULTS.md's
summary quotes, in minutes) or a dry run (--dry-run: CPU, tiny shapes, a check of the script).

A step's `gpus` says where it runs: 0 = CPU (host arithmetic or gloo ranks), 1 = one GPU,
"all" = every GPU of the machine (torchrun, one rank per GPU, over NCCL; plain python where
there is one GPU); `min_gpus` is the fewest it needs (on a machine with fewer it is skipped,
with the reason). `quick=None` leaves a step out of quick runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union


@dataclass(frozen=True)
class Step:
    name: str
    module: str
    full: Sequence[str] = ()
    quick: Optional[Sequence[str]] = ()     # None: not part of a quick run
    dry: Sequence[str] = ("--dry-run",)
    gpus: Union[int, str] = 1
    min_gpus: int = 1
    timeout_s: Dict[str, int] = field(default_factory=lambda: {"full": 3600, "quick": 600, "dry": 900})
    about: str = ""

    def args(self, mode: str) -> Optional[Sequence[str]]:
        return {"full": self.full, "quick": self.quick, "dry": self.dry}[mode]


K, C = "benchmarks.kernels", "benchmarks.cp_sim"
CP8 = ["--cps", "8", "--block-keys", "32768"]
H27 = ["--heads", "32", "16", "128"]

SUITES: Dict[str, List[Step]] = {
    "kernels": [
        Step("dense", K,
             full=["--pairs", "fa4:50", "fa4:0", "fa4-builtin:50", "flex:50", "flex-flash:50",
                   "sdpa:0", "fa2:50", "fa2:0", "fa3:50"],
             quick=["--seqs", "32768", "--pairs", "fa4:50", "flex:50", "sdpa:0", "fa2:50",
                    "--rep-ms", "100"],
             about="softcap kernels vs cuDNN (no cap) at Gemma2 9B/27B heads, 8K/32K; "
                   "cps.attention's overhead; FA4's two softcap implementations; flex direct"),
        Step("packed", "benchmarks.packed_kernels",
             quick=["--models", "9B", "--kernels", "fa4", "fa4-kernel", "library-only",
                    "--rep-ms", "100"],
             about="packed documents (128K streams) per kernel vs cuDNN on a dense call of the "
                   "same area; FA4's varlen function alone; the library's own time"),
        Step("sinks", "benchmarks.sinks_cost",
             quick=None,
             about="attention sinks against the same call without them, gpt-oss shapes"),
    ],
    "cp_sim": [
        Step("unpacked", C,
             quick=["--seqs", "32768", *CP8, "--rep-ms", "100"],
             about="one zigzag ring rank on one GPU, 9B heads: rank time x cp / full attention"),
        Step("27b", C,
             full=["--seqs", "32768", "131072", *CP8, *H27, "--per-call", "--tag", "27b"],
             quick=["--seqs", "32768", *CP8, *H27, "--rep-ms", "100", "--tag", "27b"],
             dry=["--dry-run", "--tag", "27b"],
             about="the same at 27B heads (and every call of the rank timed alone)"),
        Step("window", C,
             full=["--seqs", "32768", "131072", *CP8, "--window", "4095", "--graph", "--tag", "window"],
             quick=["--seqs", "32768", *CP8, "--window", "4095", "--graph", "--rep-ms", "100",
                    "--tag", "window"],
             dry=["--dry-run", "--window", "63", "--tag", "window"],
             about="Gemma2's local layers (window 4095), also as CUDA-graph replay"),
        Step("packed_longtail", C,
             full=["--packed", "longtail", "--seqs", "131072", "--cps", "8", "--kernel", "fa4",
                   "--tag", "fa4"],
             quick=["--packed", "longtail", "--seqs", "131072", "--cps", "8", "--kernel", "fa4",
                    "--rep-ms", "60", "--tag", "fa4"],
             dry=["--dry-run", "--packed", "longtail", "--kernel", "torch", "--rep-ms", "1"],
             about="a packed 128K stream (long-tailed documents) at cp 8: busiest rank / ideal"),
        Step("packed_short", C,
             full=["--packed", "short", "--seqs", "131072", "--cps", "8", "--kernel", "fa4",
                   "--tag", "fa4"],
             quick=None,
             dry=["--dry-run", "--packed", "short", "--kernel", "torch", "--rep-ms", "1"],
             about="the same with short documents"),
    ],
    "multi": [
        Step("cp_multi", "benchmarks.cp_multi", gpus="all", min_gpus=1, quick=None,
             about="cps.cp_attention over NCCL, one rank per GPU, every comm, vs ideal "
                   "(one GPU: the single-device path's overhead)"),
        Step("cp_multi_window", "benchmarks.cp_multi", gpus="all", min_gpus=2,
             full=["--window", "4095", "--tag", "window"], quick=None,
             dry=["--dry-run", "--window", "63", "--tag", "window"],
             about="the same for Gemma2's local layers"),
    ],
    "training": [
        Step("speed", "benchmarks.training.speed",
             full=["--config", "2b", "--seq-len", "8192", "--batch-size", "1", "--no-progress"],
             quick=None,
             dry=["--device", "cpu", "--config", "tiny", "--seq-len", "64", "--batch-size", "1",
                  "--no-progress", "--warm", "1", "--steps", "1", "--variants", "1", "--no-profile"],
             about="the Gemma2 example's step (2b, 8K tokens): time, tokens/s, MFU, peak memory "
                   "with each Liger piece on and off; the top kernels"),
        Step("memcheck", "benchmarks.training.memcheck",
             full=["--config", "2b", "--seq-len", "32768", "--batch-size", "1", "--ac",
                   "selective", "--no-progress"],
             quick=None,
             dry=["--device", "cpu", "--config", "tiny", "--seq-len", "128", "--batch-size", "1",
                  "--no-progress"],
             about="the memory plan against the measured peak (2b, 32K tokens, selective AC)"),
        Step("plan_table", "benchmarks.training.plan_table", gpus=0, quick=None,
             about="the example's memory-plan table (host arithmetic)"),
        Step("lm_loss", "benchmarks.lm_loss", quick=None,
             about="the LM head's softcapped loss alone at 2b's shapes, against Liger's"),
    ],
    "compile": [
        Step("compile_modes", "benchmarks.compile_modes",
             quick=["--modes", "blocks", "--steps", "8"],
             dry=["--dry-run", "--modes", "eager"],
             about="the example's MFU with --compile blocks / pieces / eager (2b, 8K tokens)"),
    ],
    "hf": [
        Step("hf_attention", "benchmarks.hf_attention",
             quick=None,
             dry=["--dry-run", "--steps", "1"],
             about="HF Gemma2 with attn_implementation='cp_softcap' vs HF's own implementations"),
    ],
    "peers": [
        Step("peers", "benchmarks.peers", gpus="all", min_gpus=1,
             quick=["--models", "9B", "--local-seqs", "32768", "--layouts", "causal", "--comms",
                    "auto", "--cps-backends", "auto"],
             about="cps next to ring-flash-attn, yunchang and PyTorch's context_parallel: "
                   "exactness and fwd+bwd time"),
        Step("torch_cp", "benchmarks.torch_cp", gpus="all", min_gpus=2, quick=None,
             about="cps next to PyTorch's context_parallel on N GPUs"),
    ],
    "models": [
        Step("comm_bytes", "benchmarks.comm_bytes", gpus=0, quick=["--quick"], dry=["--quick"],
             about="bytes sent per rank per layer, counted on 8 gloo ranks (stand-in kernel)"),
        Step("ring_cpu", "benchmarks.ring_cpu", gpus=0, quick=["--quick"], dry=["--quick", "--cp", "2"],
             about="the ring's framework overhead and forward peak memory on CPU"),
        Step("scaling_model", "benchmarks.scaling_model", gpus=0, quick=["--quick"],
             dry=["--quick"], about="a model of 8-128 GPUs from the one-GPU measurements"),
        Step("packed_bytes", "benchmarks.packed_bytes", gpus=0, quick=["--dry-run"],
             about="bytes per rank with packed documents (the byte model)"),
        Step("packing_balance", "benchmarks.packing_balance", gpus=0, quick=["--dry-run"],
             about="packed documents: the busiest rank's area over the mean, per layout"),
        Step("tile_model", "benchmarks.tile_model", gpus=0,
             about="FA4's sm90 tiles and CTAs fitted to the H100 records: where short calls and "
                   "short documents lose time (useful work, tile edges, CTA cost, tail, memory)"),
    ],
}
