"""What is applied to the model before training, in this order (as torchtitan does): activation
checkpointing, torch.compile of each decoder layer, then data parallelism: FSDP2 (--fsdp) or
DDP."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .parallel import Dist

AC_MODES = ("none", "full", "selective")


def apply_ac(model, mode: str) -> None:
    """--ac: "none"; "full" recomputes every decoder layer in backward (CP attention and its
    collectives included); "selective" recomputes the feed-forward half of every layer and
    keeps attention's activations (examples/gemma2/README.md, "Activation checkpointing", has
    the measurement behind this choice)."""
    if mode not in AC_MODES:
        raise ValueError(f"--ac {mode!r}: choose one of {', '.join(AC_MODES)}")
    per_layer = {"none": "none", "full": "full", "selective": "mlp"}[mode]
    for layer in model.model.layers:
        layer.ac = per_layer


COMPILE_MODES = ("blocks", "pieces")


def apply_compile(model, mode: str = "blocks", backend: str = "inductor") -> None:
    """--compile: "blocks" (the default) compiles each decoder layer whole with fullgraph=True, as
    torchtitan does; CPAttention runs inside the graph as one opaque operator of the library (its
    collectives and kernels run as they do eagerly), so the compiler sees every other piece of
    the layer at once. "pieces" compiles only the three pieces around attention
    (pre_attention, post_attention, feed_forward), attention running eagerly between them: two
    graph breaks per layer, kept for comparison. Module.compile compiles in place, so parameter
    names (checkpoints, FSDP2) are unchanged. backend: torch.compile's (tests use "aot_eager")."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile {mode!r}: choose one of {', '.join(COMPILE_MODES)}")
    for layer in model.model.layers:
        if mode == "blocks":
            layer.compile(fullgraph=True, backend=backend)
        else:
            for name in ("pre_attention", "post_attention", "feed_forward"):
                setattr(layer, name, torch.compile(getattr(layer, name), backend=backend))


def apply_fsdp(model, d: Dist, compute_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 over all dp x cp ranks (d.grad_mesh; each decoder layer, then the root): parameters,
    gradients and optimizer state sharded. Gradients are SUMMED, not averaged, as the CP recipe
    needs.

    With a bf16 compute dtype the layers are gathered in bf16 and gradients reduced in float32
    (MixedPrecisionPolicy): under autocast alone, every layer's bf16 weight copies would stay
    alive from forward to backward (2 bytes per parameter of the whole model on every rank)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = d.grad_mesh
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)    # gloo has no pre-divided reduce-scatter


def apply_ddp(model, d: Dist, bucket_cap_mb: Optional[float] = None) -> None:
    """Data parallelism without sharding: every rank keeps the whole model, and torch's DDP (the
    composable `replicate`: the model keeps its class and parameter names, so checkpoints are
    those of an unwrapped model) SUMS the gradients over all dp x cp ranks (d.grad_mesh) as
    backward produces them, bucket by bucket, so that the reduction overlaps the rest of
    backward. Summed, not averaged, as the CP recipe needs (step.py). Gradients are views into
    DDP's buckets (no second copy after backward). bucket_cap_mb: DDP's bucket size (None: its
    default)."""
    from torch.distributed._composable.replicate import replicate

    group = d.grad_group
    kw = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    replicate(model, process_group=group, gradient_as_bucket_view=True, **kw)
    model.register_comm_hook(group, _sum_each_gradient)
    # Each decoder layer is one graph (apply_compile) whose backward hands DDP that layer's
    # gradients; dynamo's DDP optimizer would split every layer's graph again at bucket
    # boundaries, so the layers would compile differently from FSDP2 or one device.
    torch._dynamo.config.optimize_ddp = False


def is_replicated(model) -> bool:
    """Whether apply_ddp has been applied to `model`."""
    from torch.distributed._composable.replicate import DDP
    return isinstance(model, DDP)


def _sum_each_gradient(group, bucket):
    """DDP communication hook: SUM the bucket's gradients over `group`, one all-reduce per
    gradient. Per gradient rather than the bucket's flat buffer: where an element sits in the
    buffer decides its order of summation (a ring all-reduce adds each chunk of the buffer in
    its own rank order), and DDP regroups its buckets after the first step, so flat buckets
    would make a step after resuming from a checkpoint differ in rounding from the same step of
    an uninterrupted run (on more than 2 ranks)."""
    works = [dist.all_reduce(g, group=group, async_op=True) for g in bucket.gradients()]
    return torch.futures.collect_all([w.get_future() for w in works]).then(lambda _: bucket.buffer())
