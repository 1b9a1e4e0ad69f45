"""Per-rank memory plan, made before anything is built on a device: parameter counts come from the
model built on the meta device, everything else from the flags. examples/gemma2/README.md ("Memory plan") explains
each row and shows how it compares with measured peaks.

Bytes per token of one decoder layer's saved activations are counted tensor by tensor from what
autograd keeps in model.py's forward: float32 weights, the residual stream and the RMSNorm
internals in float32, and under bf16 autocast the matmul inputs and outputs in bf16.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import List, NamedTuple, Optional, Tuple

from cp_softcap.sharding import fits_zigzag

GIB = 1 << 30
RING_BLOCK_KEYS = 32768      # cp_softcap's default for CP_SOFTCAP_RING_BLOCK_KEYS
# What a GPU process holds outside PyTorch's caching allocator (the CUDA context, loaded kernel
# modules: FA4's CuTe kernels, Triton's, cuBLAS): 1.28 GiB on an H100 (torch 2.11, FA4, Liger)
# when 2b at 131,072 tokens ran out of memory (78.53 GiB in use, 77.25 of it PyTorch's). The plan
# leaves this much of the GPU's total to it.
CUDA_OUTSIDE_ALLOCATOR = 3 * GIB // 2
# What torch reports as an 80 GB H100's total (get_device_properties(0).total_memory: "a total
# capacity of 79.11 GiB"): what --plan plans against on a machine without a GPU, when
# --device-mem-gib does not say otherwise.
H100_TOTAL = int(79.11 * GIB)


@dataclass(frozen=True)
class Job:
    """What the plan depends on (one rank's view)."""
    cfg: object                  # Gemma2Config
    seq_len: int
    batch: int                   # sequences per dp rank
    world: int
    cp: int
    fsdp: bool = False
    ac: str = "none"
    dtype: str = "float32"       # compute dtype: float32, or bfloat16 autocast over float32 weights
    comm: str = "ring"
    loss_chunk: Optional[int] = None
    device_type: str = "cpu"
    # pieces run fused (Liger's kernels, or inductor's under --compile): they keep less
    fused: Tuple[str, ...] = ()

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def tokens(self) -> int:     # tokens this rank holds
        return self.batch * self.seq_len // self.cp


class ParamCounts(NamedTuple):
    layer: int          # one decoder layer
    root: int           # outside the layers
    attention: int      # one layer's attention half (q/k/v/o)
    mlp: int            # one layer's feed-forward half (gate/up/down)


def param_counts(cfg) -> ParamCounts:
    """Parameter counts from the meta model."""
    import torch
    from .model import Gemma2

    with torch.device("meta"):
        model = Gemma2(cfg)
    first = model.model.layers[0]
    layer = sum(p.numel() for p in first.parameters())
    return ParamCounts(layer, model.num_params() - layer * cfg.num_hidden_layers,
                       sum(p.numel() for p in first.self_attn.parameters()),
                       sum(p.numel() for p in first.mlp.parameters()))


def _halves(cfg, act: int, fused: Tuple[str, ...] = ()) -> Tuple[int, int]:
    """Saved bytes per token of a layer's attention half and feed-forward half (act = 2 or 4),
    with `fused` the pieces run by a fused kernel (fused.PIECES names)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    lse = 4 * cfg.num_attention_heads
    if act == 4:     # x, norm y, normed; q/k: raw, rotated half, roped; v; attention out; o_proj out, norm y
        attn, mlp = 20 * h + 16 * q + 16 * kv + lse, 20 * h + 16 * i
    else:
        # bf16 autocast: float32 residual and norm internals, bf16 copies into each matmul (one
        # shared copy for q/k/v and one for gate/up: model.autocast_inputs)
        attn, mlp = 14 * h + 8 * q + 8 * kv + lse, 16 * h + 8 * i
    # Fused pieces keep less (counted with saved_tensors_hooks on the pieces as Liger saves
    # them; for --compile it is assumed that inductor's partitioner recomputes the same pointwise
    # work instead of keeping it, which the 2b 8K --compile peak on an H200 agreed with, 0.98x):
    # RMSNorm keeps its input and one float32 per row, not the float32 normalised copies (two
    # norms per half); GEGLU keeps gate and up, not gelu(gate) too. RoPE keeps cos and sin
    # either way.
    if "rms_norm" in fused:
        norms = (10 if act == 2 else 8) * h
        attn, mlp = attn - norms, mlp - norms
    if "geglu" in fused:
        mlp -= act * i
    return attn, mlp


def _kernel_scratch(job: Job, queries: int, keys: int, heads: int) -> int:
    """One kernel call's working memory. GPU kernels (flash-attn, FlexAttention) tile scores on
    chip: float32 output and LSE partials only. On CPU the pure-PyTorch kernel works on score
    blocks of up to 1024 x 1024 (halved until one holds at most 2**23 entries) and holds about
    five float32 block-sized temporaries, six and a half when a call spans several blocks
    (measured with memcheck.py at cp 1, 2 for every comm)."""
    c = job.cfg
    partials = job.batch * heads * queries * (c.head_dim + 1) * 4
    if job.device_type == "cuda":
        return 2 * partials
    block = job.batch * heads * min(queries, 1024) * min(keys, 1024)
    temporaries = 5.0 if block <= 1 << 23 and max(queries, keys) <= 1024 else 6.5
    return int(temporaries * min(block, 1 << 23) * 4) + partials


def _attention_buffers(job: Job, act: int) -> int:
    """Bytes one CPAttention call holds beyond its saved tensors (forward or backward)."""
    c = job.cfg
    t, s = job.tokens, job.seq_len
    kv = c.num_key_value_heads * c.head_dim
    q = c.num_attention_heads * c.head_dim
    local = s // job.cp
    if job.cp == 1:
        return _kernel_scratch(job, s, s, c.num_attention_heads)
    comm = "ring" if job.comm == "auto" else job.comm
    if comm in ("ring", "a2a+p2p"):
        block = int(os.environ.get("CP_SOFTCAP_RING_BLOCK_KEYS", RING_BLOCK_KEYS))
        keys = max(local, min(block, s - local))                 # per sequence
        blocks = 2 * (2 * job.batch * keys * kv * act) + 2 * job.batch * keys * kv * 4
        return blocks + _kernel_scratch(job, local, keys, c.num_attention_heads)   # + dK/dV
    if comm == "all_gather":                                     # full K/V + float32 dK/dV
        # each of the two zigzag chunks is one call against the gathered keys
        return job.batch * s * kv * 2 * (act + 4) + _kernel_scratch(job, local // 2, s, c.num_attention_heads)
    heads = c.num_attention_heads // job.cp                      # a2a: all keys, heads / cp
    kv_heads = max(c.num_key_value_heads, job.cp)                # KV heads < cp are replicated
    reshard = 2 * t * (2 * q + 2 * kv_heads * c.head_dim) * act  # q/k/v/out and their grads
    return reshard + _kernel_scratch(job, s, s, heads)


def _loss_buffers(job: Job, act: int) -> int:
    from .loss import default_chunk
    v, h = job.cfg.vocab_size, job.cfg.hidden_size
    chunk = min(job.tokens, job.loss_chunk or default_chunk(v))
    bf16_copy = 2 * v * h if act == 2 and not job.fsdp else 0     # FSDP gathers it in bf16
    return 3 * chunk * v * 4 + 4 * v * h + bf16_copy


def estimate(job: Job) -> List[Tuple[str, int]]:
    """[(row, bytes)] for one rank; the last row is the peak."""
    c = job.cfg
    counts = param_counts(c)
    layer, root = counts.layer, counts.root
    n_layers = c.num_hidden_layers
    total = layer * n_layers + root
    act = 2 if job.dtype == "bfloat16" else 4
    shard = job.world if job.fsdp else 1
    attn_half, mlp_half = _halves(c, act, job.fused)
    # the residual stream: float32 (float32 weights), bf16 when FSDP2 gathers bf16 weights
    res = 2 if act == 2 and job.fsdp else 4
    per_layer = {"none": attn_half + mlp_half, "selective": attn_half + res * c.hidden_size,
                 "full": res * c.hidden_size}[job.ac]    # AC keeps the layer's input per token
    recompute = {"none": 0, "selective": mlp_half, "full": attn_half + mlp_half}[job.ac]
    t = job.tokens
    base = [("parameters (float32)", 4 * total // shard),
            ("optimizer state (AdamW, 2 x float32)", 8 * total // shard)]
    ddp = not job.fsdp and job.world > 1
    if ddp:    # parallelize.apply_ddp: the gradients are views into them
        base.append(("gradients: DDP's buckets (float32, kept)", 4 * total))
    during = [("activations kept for backward", t * (per_layer * n_layers + 12 * c.hidden_size
                                                     + 8 * c.head_dim)),
              ("activations of one layer recomputed (AC)", t * recompute),
              (f"attention buffers ({job.comm})", _attention_buffers(job, act)),
              ("loss slices + tied-embedding gradient", _loss_buffers(job, act))]
    if act == 2 and not job.fsdp:
        # autocast's bf16 copy of each weight lives as long as the matmul's saved input: AC drops
        # the copies of what it recomputes, and the recompute holds one layer's again
        kept = {"none": layer * n_layers, "selective": counts.attention * n_layers + counts.mlp,
                "full": layer}[job.ac]
        during.append(("bf16 weight copies kept for backward (autocast)", 2 * kept))
        # autocast also caches every weight's copy until its block ends, after the loss: with AC
        # the copies AC would drop are still there while the loss runs
        during.append(("bf16 weight copies in autocast's cache, until the loss ends",
                       2 * (layer * n_layers - kept)))
    if job.fsdp:       # gathered weights and their grads, and a float32 reduce-scatter input
        during.append(("FSDP2 unsharded embedding + 2 layers", (2 * res) * (root + 2 * layer) + 4 * layer))
        end = [("gradients (sharded) + embedding reduce-scatter", 4 * total // shard + 4 * root)]
    elif ddp:     # before its second step DDP regroups the buckets: old and new alive at once
        end = [("DDP's buckets regrouped before step 2 (2 sets)", 4 * total)]
    else:
        end = [("gradients (float32)", 4 * total)]
    rows = [(f"{name} [step]", b) for name, b in during] + [(f"{name} [end]", b) for name, b in end]
    static = sum(b for _, b in base)
    # the loss runs after the last layer's forward and before the first layer's backward, so its
    # slices (and autocast's cached weight copies) never coexist with a layer's attention
    # buffers or recomputed activations
    held = {name: b for name, b in during}
    loss = held.pop("loss slices + tied-embedding gradient")
    loss += held.pop("bf16 weight copies in autocast's cache, until the loss ends", 0)
    layer = sum(b for name, b in held.items() if name.startswith(("attention", "activations of one")))
    step = sum(held.values()) - layer + max(loss, layer)
    return base + rows + [("peak = parameters + optimizer" + (" + buckets" if ddp else "")
                           + " + max([step], [end])",
                           static + max(step, end[0][1]))]


def device_memory(device_type: str, local_world: int, override_gib: Optional[float] = None) -> int:
    """Bytes one rank's tensors may use: --device-mem-gib, else the GPU's total less what CUDA
    holds outside PyTorch's allocator (CUDA_OUTSIDE_ALLOCATOR; an H100's total where this machine
    has no GPU: a --plan for a GPU run), else the host's memory shared by the ranks on it."""
    if override_gib is not None:
        return int(override_gib * GIB)
    if device_type == "cuda":
        return _gpu_total() - CUDA_OUTSIDE_ALLOCATOR
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local_world)


def _gpu_total() -> int:
    import torch
    if not torch.cuda.is_available():
        return H100_TOTAL
    return torch.cuda.get_device_properties(0).total_memory


def limit_note(job: Job, limit: int) -> str:
    """Where the limit of a GPU plan made without a GPU comes from, or ""."""
    import torch
    if job.device_type != "cuda" or torch.cuda.is_available() or limit != H100_TOTAL - CUDA_OUTSIDE_ALLOCATOR:
        return ""
    return (f"  (no GPU here: planned against an 80 GB H100, {H100_TOTAL / GIB:.2f} GiB less "
            f"{CUDA_OUTSIDE_ALLOCATOR / GIB:.1f} GiB that CUDA holds outside PyTorch's allocator; "
            "--device-mem-gib G plans for another card)")


def peak(job: Job) -> int:
    return estimate(job)[-1][1]


def what_fits(job: Job, limit: int) -> List[str]:
    """Flag changes (cheapest first) under which the estimate fits `limit`."""
    tries = [("--ac selective", dict(ac="selective")), ("--ac full", dict(ac="full")),
             ("--fsdp", dict(fsdp=True)), ("--fsdp --ac selective", dict(fsdp=True, ac="selective")),
             ("--fsdp --ac full", dict(fsdp=True, ac="full"))]
    cp = job.cp * 2
    while cp <= job.world and fits_zigzag(job.seq_len, cp):
        if job.world % cp == 0:
            tries.append((f"--cp {cp} --fsdp --ac full", dict(cp=cp, fsdp=True, ac="full")))
        cp *= 2
    if job.batch > 1:
        tries.append(("--batch-size 1 --fsdp --ac full", dict(batch=1, fsdp=True, ac="full")))
    fits = []
    for flags, change in tries:
        new = replace(job, **change)
        same = all(getattr(job, k) == v for k, v in change.items())
        if not same and peak(new) <= limit:
            fits.append(f"{flags} ({peak(new) / GIB:.1f} GiB)")
    return fits[:3]


def render(job: Job, limit: int) -> str:
    c = job.cfg
    head = (f"memory plan per rank: {job.world} ranks = dp {job.dp} x cp {job.cp}, seq {job.seq_len} "
            f"({job.tokens} tokens per rank), batch {job.batch}, {job.dtype}, ac {job.ac}, "
            f"{'FSDP2' if job.fsdp else 'replicated'}, comm {job.comm}, "
            f"{c.num_hidden_layers} layers x hidden {c.hidden_size}")
    lines = [head] + [f"  {name:<58} {b / GIB:10.3f} GiB" for name, b in estimate(job)]
    kept = {ac: dict(estimate(replace(job, ac=ac)))["activations kept for backward [step]"]
            for ac in ("none", "selective", "full")}
    lines.append("  activations kept with --ac none / selective / full: "
                 + " / ".join(f"{b / GIB:.3f}" for b in kept.values()) + " GiB")
    lines.append(f"  {'memory for tensors per rank':<58} {limit / GIB:10.3f} GiB")
    note = limit_note(job, limit)
    return "\n".join(lines + ([note] if note else []))


def check(job: Job, limit: int) -> Optional[str]:
    """None when the estimate fits `limit`, else the refusal text (with flags that would fit)."""
    need = peak(job)
    if need <= limit:
        return None
    fits = what_fits(job, limit)
    hint = ("; these would fit: " + ", ".join(fits)) if fits else \
        "; nothing among --ac/--fsdp/--cp/--batch-size fits: use more ranks or a shorter --seq-len"
    return (f"this run needs about {need / GIB:.1f} GiB per rank but the device has "
            f"{limit / GIB:.1f} GiB (--plan shows the rows){hint}. --skip-memory-check runs anyway.")
