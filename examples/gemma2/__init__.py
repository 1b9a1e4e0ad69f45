"""Gemma2 training example on cp_softcap.CPAttention (see examples/gemma2/README.md).

Setup apart from the training step, as in torchtitan: flags (every flag, checked before anything
is built), allocator (the CUDA allocator's setting, made before torch loads), parallel (device,
process group, the dp x cp DeviceMesh), parallelize (activation
checkpointing, torch.compile, FSDP2 or DDP), step (the CP recipe: one forward+backward), train (the
torchrun entry point). The model: config, model, loss (chunked softcapped cross-entropy). Around
it: data, checkpoint (DCP step-N folders), metrics, memory (the per-rank plan). The tools that
measure it (memcheck, measure, speed, gaps, plan_table) are in benchmarks/training/.
"""
