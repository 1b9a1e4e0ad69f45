"""What is applied to the model before training, in this order (as torchtitan does): activation
checkpointing, torch.compile of each decoder layer, then FSDP2."""
from __future__ import annotations

import torch

from .parallel import Dist

AC_MODES = ("none", "full", "selective")


def apply_ac(model, mode: str) -> None:
    """--ac: "none"; "full" recomputes every decoder layer in backward (CP attention and its
    collectives included); "selective" recomputes the feed-forward half of every layer and
    keeps attention's activations (README, "Activation checkpointing", has the measurement
    behind this choice)."""
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
    """FSDP2 over all dp x cp ranks (each decoder layer, then the root): parameters, gradients and
    optimizer state sharded. Gradients are SUMMED, not averaged, as the CP recipe needs.

    With a bf16 compute dtype the layers are gathered in bf16 and gradients reduced in float32
    (MixedPrecisionPolicy): under autocast alone, every layer's bf16 weight copies would stay
    alive from forward to backward (2 bytes per parameter of the whole model on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world,), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)    # gloo has no pre-divided reduce-scatter
