"""Command-line flags of train.py, checked in full before any process group or model exists.

Every rank parses the same argv, so every rank reaches the same verdict, reported once by
extras.usage_exit (rank 0 prints it and exits 2).
"""
from __future__ import annotations

import argparse
import math
import os
import shutil

from cp_softcap.sharding import fits_zigzag

from .config import CONFIGS, from_hf_json, get_config
from .data import ByteTokenizer, check_data
from .extras import RankZeroParser, usage_exit
from .fused import CHOICES, choose
from .model import weight_files
from .parallel import COMMS, check_comm
from .parallelize import AC_MODES

DTYPES = ("auto", "float32", "bfloat16")


def fail(message: str, usage: str = "") -> None:
    """Rank 0 prints `message` (after `usage`) and exits 2; the other ranks exit 0 without a word."""
    usage_exit(f"{usage}train.py: error: {message}")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parser(doc: str) -> RankZeroParser:
    p = RankZeroParser(prog="train.py", description=doc, formatter_class=_Help)
    a = p.add_argument
    a("--config", default="tiny", choices=sorted(CONFIGS), help="model shape (ignored with --model-dir)")
    a("--model-dir", help="local HF Gemma2 checkpoint dir (config.json, *.safetensors, tokenizer)")
    a("--data", help="UTF-8 text file or .pt 1-D token tensor (None: stdlib pydoc_data.topics)")
    a("--cp", type=int, help="context-parallel size (None: all ranks; dp = world / cp)")
    a("--comm", default="ring", choices=COMMS,
      help="CP algorithm: ring (zigzag ring), all_gather, a2a (Ulysses: query heads %% cp == 0), "
      "a2a+p2p (a2a in groups of --a2a-size, ring across them), auto (fewest bytes per rank)")
    a("--a2a-size", type=int, help="all-to-all group size for --comm a2a+p2p (divides cp and the heads)")
    a("--backend", default="auto", help="attention kernel: auto (cp_softcap's selector) or one of "
      "fa2, fa3, fa4, flex, sdpa, torch; it must serve this run's softcap, windows and device")
    a("--device", default="auto", choices=("auto", "cpu", "cuda"))
    a("--dtype", default="auto", choices=DTYPES,
      help="compute dtype over float32 weights (autocast); auto = bfloat16 on GPU, float32 on CPU "
      "(--plan plans a GPU run: bfloat16 unless --device cpu)")
    a("--fsdp", action="store_true", help="shard parameters, grads and optimizer state over all ranks "
      "(FSDP2); needed for 9b/27b. Off: a full replica per rank (DDP), gradients all-reduced "
      "during backward")
    a("--ac", default="none", choices=AC_MODES,
      help="activation checkpointing: full recomputes each layer in backward, selective its MLP half")
    a("--compile", nargs="?", const="blocks", default=None, choices=("blocks", "pieces"),
      help="torch.compile each decoder layer whole with fullgraph=True (blocks, the default), or "
      "only the pieces around attention (pieces: attention eager between them)")
    a("--fused", default="auto", choices=CHOICES,
      help="RMSNorm, GEGLU, RoPE and the softcapped LM-head loss on Liger Kernel's fused GPU kernels: "
      "auto = on CUDA when liger_kernel imports (with --compile only the loss), liger = insist, "
      "torch = never (the pure-PyTorch pieces)")
    a("--loss-chunk", type=int, help="tokens per cross-entropy slice (default: 256 MiB of float32 logits "
      "for the PyTorch loss, 1 GiB of bf16 logits for Liger's, which rounds it down to a power of two)")
    a("--seq-len", type=int, default=256, help="global sequence length (a multiple of 2*cp)")
    a("--batch-size", type=int, help="sequences per dp rank per step (None: 8 for a run, 1 for --plan)")
    a("--pack", action="store_true", help="each sequence packs whole documents (the corpus split at "
      "blank lines; a .pt corpus at eos tokens) with their global cu_seqlens: attention and RoPE "
      "restart per document, no label crosses a boundary. One packed row per dp rank: needs "
      "--batch-size 1 (rows would need their own boundaries)")
    a("--max-steps", type=int, default=50, help="total optimizer steps (sets the LR schedule)")
    a("--stop-after", type=int, help="stop after this many steps in this run (e.g. a job time limit)")
    a("--lr", type=float, default=3e-3, help="peak learning rate")
    a("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    a("--warmup", type=int, default=5, help="linear warmup steps")
    a("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    a("--grad-clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    a("--seed", type=int, default=0, help="model init seed (all ranks); data seeds add the dp rank")
    a("--ckpt-dir", help="checkpoint folder; resumes from its newest complete step-N")
    a("--ckpt-every", type=int, default=0, help="save every N steps (0 = only at the end)")
    a("--keep", type=int, default=2, help="complete checkpoints to keep in --ckpt-dir: older ones "
      "are deleted after each save (0 = keep all)")
    a("--metrics", help="append one JSON line per step here (rank 0; its directory must exist); "
      "mfu is null on CPU")
    a("--log-every", type=int, default=1, help="print a metrics line every N steps")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--plan", action="store_true", help="print the per-rank memory plan for --world-size ranks "
      "and exit (no process group, nothing on a device): a GPU run (bf16, batch 1 unless given) "
      "against this GPU's memory, --device-mem-gib, or without either an H100's 80 GB; "
      "--device cpu plans a CPU run")
    a("--world-size", type=int, help="ranks the --plan is for (None: torchrun's WORLD_SIZE, else 1)")
    a("--device-mem-gib", type=float, help="memory per rank for tensors, for the plan and the "
      "check (None: the GPU's total less 1.5 GiB that CUDA holds outside PyTorch's allocator; "
      "for --plan on a machine without a GPU an H100's (79.1 GiB) less the same; on CPU the "
      "host's memory divided by the ranks on it)")
    a("--skip-memory-check", action="store_true", help="start even when the plan says it will not fit")
    return p


_AT_LEAST = (("seq_len", 1), ("batch_size", 1), ("max_steps", 1), ("stop_after", 1), ("warmup", 0),
             ("ckpt_every", 0), ("keep", 0), ("log_every", 1), ("cp", 1), ("loss_chunk", 1),
             ("world_size", 1), ("grad_clip", 0), ("weight_decay", 0), ("device_mem_gib", 0))
_FLOATS = ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "device_mem_gib")


def _number_problems(args):
    for name in _FLOATS:
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            yield f"--{name.replace('_', '-')} must be a finite number, got {value}"
    for name, low in _AT_LEAST:
        value = getattr(args, name)
        if value is not None and value < low:
            yield f"--{name.replace('_', '-')} must be >= {low}, got {value}"
    if math.isfinite(args.lr) and args.lr <= 0:
        yield f"--lr must be > 0, got {args.lr}"
    if math.isfinite(args.min_lr_ratio) and not 0 <= args.min_lr_ratio <= 1:
        yield (f"--min-lr-ratio must be in [0, 1] (the cosine ends at lr * ratio), "
               f"got {args.min_lr_ratio}")


def _problems(args, world: int, cfg):
    yield from _number_problems(args)
    cp = args.cp or world
    if args.cp and world % args.cp:
        yield (f"--cp {args.cp} must divide the world size {world} (dp = world / cp); "
               f"divisors: {', '.join(str(c) for c in range(1, world + 1) if world % c == 0)}")
    if cp >= 1 and args.seq_len >= 1 and not fits_zigzag(args.seq_len, cp):   # also when --cp is refused
        good = (args.seq_len // (2 * cp) + 1) * 2 * cp
        yield (f"--seq-len {args.seq_len} must be a multiple of 2*cp = {2 * cp} (zigzag: 2 chunks per "
               f"CP rank); use --seq-len {good}, or a different --cp")
    if args.pack and args.batch_size != 1:
        yield (f"--pack packs one row per dp rank per step (each row has its own document "
               f"boundaries); use --batch-size 1, not {args.batch_size}")
    try:
        check_comm(args.comm, cp, cfg.num_attention_heads, args.a2a_size)
    except ValueError as e:
        yield str(e)
    if not args.model_dir and cfg.vocab_size < ByteTokenizer.vocab_size:
        yield f"config {args.config} has vocab {cfg.vocab_size} < {ByteTokenizer.vocab_size} byte tokens"
    yield from _backend_problems(args, cp, cfg)
    yield from _path_problems(args)
    if not args.plan:       # the plan needs only shapes: no corpus, weights or kernels
        yield from _input_problems(args, cfg)
        try:
            choose(args.fused, device_type(args), args.compile)
        except ValueError as e:
            yield str(e)
    if args.compile and device_type(args) == "cpu" and not args.plan and \
            not any(map(shutil.which, ("g++", "c++", "clang++"))):
        yield "--compile on CPU needs a C++ compiler (g++, c++ or clang++) on PATH; install one or drop --compile"
    if args.device == "cuda" and device_type(args) != "cuda" and not args.plan:
        yield (f"--device cuda needs one GPU per local rank ({local_world()} on this node); "
               f"use --nproc-per-node <= the GPU count or --device cpu")


def _backend_problems(args, cp: int, cfg):
    """--backend (or CP_SOFTCAP_BACKEND) must name a kernel that can serve both layer kinds on
    this run's device and dtype: the selector's own verdict, before anything is built."""
    from cp_softcap import selector
    from .metrics import layer_specs
    if args.backend != "auto" and args.backend not in selector.KERNEL_NAMES:
        yield f"--backend {args.backend!r} is not a kernel; choose auto, {', '.join(selector.KERNEL_NAMES)}"
        return
    try:
        forced = selector.requested_backend(args.backend)
    except ValueError as e:      # CP_SOFTCAP_BACKEND names no kernel
        yield str(e)
        return
    if forced is None:      # auto: the selector falls back to the torch kernel, which serves all
        return
    import torch
    if args.plan and device_type(args) == "cuda" and not torch.cuda.is_available():
        return              # a plan for a GPU run made without one: no GPU kernel can be probed here
    if device_type(args) == "cuda":
        # a kernel's probe starts CUDA on the current device: make it this rank's own GPU (the
        # one it trains on), not GPU 0 for every local rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    specs = layer_specs(cfg, cp, args, device_type(args), getattr(torch, compute_dtype(args)))
    for kind, spec in specs:
        reason = selector.rejection(forced, spec)
        if reason:
            able = [n for n in selector.KERNEL_NAMES
                    if not any(selector.rejection(n, s) for _, s in specs)]
            yield (f"--backend {forced} cannot serve the {kind} layers on {device_type(args)}: {reason}; "
                   f"use --backend auto (here: {' or '.join(able) or 'no kernel'})")
            return


def _input_problems(args, cfg):
    """--data and --model-dir, read now with the loader's own checks (data.check_data)."""
    if args.model_dir:
        try:
            weight_files(args.model_dir)
        except (OSError, ValueError) as e:
            yield str(e)
    try:
        check_data(args.data, vocab_size=cfg.vocab_size, seq_len=args.seq_len, pack=args.pack,
                   model_dir=args.model_dir, eos_id=cfg.eos_token_id)
    except (OSError, ValueError) as e:
        yield str(e)


def _creatable_dir(path: str):
    """None when `path` is a writable directory or can be made one, else the reason it cannot."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


def _path_problems(args):
    """Output paths are checked now, not at the first save after hours of training."""
    if args.ckpt_dir is not None:
        reason = _creatable_dir(args.ckpt_dir)
        if reason:
            yield f"--ckpt-dir {args.ckpt_dir!r} {reason}; pass a directory (created if missing)"
    if args.metrics is not None:
        parent = os.path.dirname(os.path.abspath(args.metrics))
        if os.path.isdir(args.metrics):
            yield f"--metrics {args.metrics!r} is a directory; pass a file path (lines are appended)"
        elif not os.path.isdir(parent):
            yield (f"--metrics {args.metrics!r}: its directory {parent} does not exist; create it "
                   "first (--metrics does not create directories)")
        elif not os.access(args.metrics if os.path.exists(args.metrics) else parent, os.W_OK):
            yield f"--metrics {args.metrics!r} is not writable"


def local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def device_type(args) -> str:
    """"cuda" when every local rank can have a GPU (and --device allows), else "cpu". --plan
    plans a GPU run on any machine unless --device cpu."""
    if getattr(args, "plan", False):
        return "cpu" if args.device == "cpu" else "cuda"
    import torch
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "cuda" if args.device != "cpu" and 0 < local_world() <= n_gpu else "cpu"


def compute_dtype(args) -> str:
    if args.dtype != "auto":
        return args.dtype
    return "bfloat16" if device_type(args) == "cuda" else "float32"


def parse(argv=None, doc: str = ""):
    """(args, cfg, world): parsed and checked; every problem is reported at once, then exit 2."""
    p = parser(doc)
    args = p.parse_args(argv)
    world = args.world_size or int(os.environ.get("WORLD_SIZE", 1))
    if args.world_size and not args.plan:
        p.error("--world-size is for --plan; under torchrun the world size is the number of ranks")
    try:
        cfg = from_hf_json(args.model_dir) if args.model_dir else get_config(args.config)
    except (OSError, ValueError) as e:
        p.error(str(e))
    if args.batch_size is None:         # a plan is for what a user would run: one sequence
        args.batch_size = 1 if args.plan else 8
    problems = list(_problems(args, world, cfg))
    if problems:
        p.error("\n  " + "\n  ".join(problems))
    return args, cfg, world
