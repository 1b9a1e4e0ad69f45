"""Workers for tests_dist/test_hf_trainer_dist.py: the same HF Trainer fine-tuning of a tiny Gemma2
(attention softcap 3 saturated by large weights, final softcap 5, window 16 < 32 tokens,
gradient accumulation 2, gradient clipping, evaluation, checkpoint save and resume, an
IterableDataset) run two ways.

    python tests_dist/hf_trainer_workers.py ref OUT_DIR          # plain Trainer, eager float64, 1 process
    python -m torch.distributed.run --nproc-per-node 4 tests_dist/hf_trainer_workers.py cp OUT_DIR
    python tests_dist/fork_launch.py hf_trainer_workers OUT_DIR     # both, forked (the tests)

Each run writes OUT_DIR/<name>.json (logged train losses and grad norms, eval loss) and
OUT_DIR/<name>.pt (final weights); the cp mode ends with the example's own main(). The data
order is sequential, so a global batch of dp x per-device rows is the same documents as the
one-process run's batch of dp x per-device rows; packed runs (DataCollatorWithFlattening: one
row per batch) take the same documents as the padded rows of the reference, so the same tokens
are predicted.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gemma2"))
import hf_trainer as example  # noqa: E402  (examples/gemma2/hf_trainer.py)

SEQ, STEPS, GA, PER_DEVICE = 32, 3, 2, 2


def model(attn: str):
    """The example's tiny Gemma2 with a small attention cap and weights large enough that most
    scores are far above 2 * cap (the cap saturates)."""
    m = example.tiny_gemma2(attn, softcap=3.0, final_softcap=5.0, window=16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.25))
    return m


def data(dp: int, packed: bool = False):
    """Train and eval documents: padded rows, or the same documents unpadded for packing."""
    return (example.text_rows(STEPS * GA * PER_DEVICE * dp, SEQ, packed=packed),
            example.text_rows(3 * PER_DEVICE, SEQ, seed=1, packed=packed))   # dp 2: a partial batch


def boundaries_dropped(features):
    """Negative control: the packed row as ONE sequence (documents attend to each other)."""
    from cp_softcap.sharding import pad_to_multiple
    batch = transformers.DataCollatorWithFlattening()(features)
    return {"input_ids": pad_to_multiple(batch["input_ids"], 8),
            "labels": pad_to_multiple(batch["labels"], 8, value=-100)}


def sequential(cls):
    """`cls` with the training data read in order (Trainer shuffles by default)."""
    class Sequential(cls):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)
    return Sequential


def args(tmp: str, per_device: int, **kw):
    kw = {"per_device_train_batch_size": per_device, "per_device_eval_batch_size": PER_DEVICE,
          "gradient_accumulation_steps": GA, "max_steps": STEPS, "optim": "sgd", "learning_rate": 0.05,
          "max_grad_norm": 1.0, "dataloader_drop_last": False, **kw}
    return example.training_args(tmp, **kw)


def record(trainer, out_dir: str, name: str) -> None:
    metrics = trainer.evaluate()
    if trainer.args.process_index != 0:
        return
    steps = [h for h in trainer.state.log_history if "loss" in h]
    from torch._dynamo.utils import counters
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"losses": [h["loss"] for h in steps], "grad_norms": [h["grad_norm"] for h in steps],
                   "eval_loss": metrics["eval_loss"],
                   "graphs": counters["stats"]["unique_graphs"]}, f)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
               os.path.join(out_dir, name + ".pt"))


def reference(out_dir: str) -> None:
    torch.set_num_threads(1)
    for dp in (1, 2):
        train, evaluation = data(dp)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = sequential(transformers.Trainer)(
                model=model("eager").double(), args=args(tmp, PER_DEVICE * dp), train_dataset=train,
                eval_dataset=evaluation)
            trainer.train()
            record(trainer, out_dir, f"ref_dp{dp}")


def cp_runs(out_dir: str) -> None:
    from cp_softcap.integrations.hf_trainer import CPTrainer, cp_mesh
    torch.set_num_threads(1)
    flatten = transformers.DataCollatorWithFlattening()
    runs = [("dp2_cp2_ring", 2, "ring", {}), ("dp1_cp4_a2a", 4, "a2a", {}),
            ("dp2_cp2_ring_packed", 2, "ring", {"collator": flatten}),
            ("dp1_cp4_all_gather_packed", 4, "all_gather", {"collator": flatten}),
            ("dp2_cp2_ring_per_rank", 2, "ring", {"per_rank": True}),
            ("dp2_cp2_ring_no_boundaries", 2, "ring", {"collator": boundaries_dropped}),
            # torch_compile=True: the model compiled by Trainer (aot_eager here: inductor's C++
            # compile of every graph would dominate CI; the library's operators are the same)
            ("dp2_cp2_ring_packed_compiled", 2, "ring", {"collator": flatten, "compile": True})]
    with tempfile.TemporaryDirectory() as tmp:
        targs = args(tmp, PER_DEVICE)
        meshes = {cp: cp_mesh(cp) for cp in (2, 4)}
        for name, cp, comm, control in runs:
            mesh = meshes[cp]
            train, evaluation = data(mesh.size(0), packed="collator" in control)
            run_args = (args(tmp, PER_DEVICE, torch_compile=True, torch_compile_backend="aot_eager")
                        if control.get("compile") else targs)
            trainer = sequential(CPTrainer)(model=model("cp_softcap"), args=run_args, cp_mesh=mesh,
                                            cp_comm=comm, data_collator=control.get("collator"),
                                            train_dataset=train, eval_dataset=evaluation)
            if control.get("per_rank"):      # negative control: each rank's loss over its own tokens
                trainer.args.average_tokens_across_devices = False
            trainer.train()
            trainer.args.average_tokens_across_devices = True
            record(trainer, out_dir, name)
        resumed(out_dir, meshes[2])
        shuffled(out_dir, targs, meshes[2])
        refused = iterable(out_dir, tmp, meshes[2])
        refusals(out_dir, targs, meshes[2], refused)
    example.main(["--steps", "2"])           # the example as README runs it (dp 2 x cp 2, ring)


def resumed(out_dir: str, mesh) -> None:
    """dp 2 x cp 2 ring saved at step 2, then a new Trainer resumed from that checkpoint (in
    out_dir: every rank reads the files rank 0 wrote)."""
    from cp_softcap.integrations.hf_trainer import CPTrainer
    ckpt = os.path.join(out_dir, "ckpt")
    train, evaluation = data(mesh.size(0))
    first = args(ckpt, PER_DEVICE, save_strategy="steps", save_steps=2, max_steps=2)
    sequential(CPTrainer)(model=model("cp_softcap"), args=first, cp_mesh=mesh, cp_comm="ring",
                          train_dataset=train).train()
    trainer = sequential(CPTrainer)(model=model("cp_softcap"), args=args(ckpt, PER_DEVICE), cp_mesh=mesh,
                                    cp_comm="ring", train_dataset=train, eval_dataset=evaluation)
    trainer.train(resume_from_checkpoint=os.path.join(ckpt, "checkpoint-2"))
    record(trainer, out_dir, "dp2_cp2_ring_resumed")


def shuffled(out_dir: str, targs, mesh) -> None:
    """Trainer's default shuffled sampler: the CP ranks of a dp group get the same packed batch
    (same global boundaries), the dp groups different ones. Writes shuffled.json on rank 0."""
    import torch.distributed as dist
    from cp_softcap.integrations.hf_trainer import CPTrainer
    seen = []

    class Spy(CPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            bounds = inputs["cu_seqlens"].cu_seqlens           # the batch's PackedLayout
            cu = torch.full((64,), -1, dtype=torch.int64)
            cu[:len(bounds)] = torch.tensor(bounds)
            every = [torch.empty_like(cu) for _ in range(dist.get_world_size())]
            dist.all_gather(every, cu)
            seen.append([e[e >= 0].tolist() for e in every])
            return super().training_step(model, inputs, num_items_in_batch)

    train, _ = data(mesh.size(0), packed=True)
    Spy(model=model("cp_softcap"), args=targs, cp_mesh=mesh, train_dataset=train,
        data_collator=transformers.DataCollatorWithFlattening()).train()
    if targs.process_index == 0:
        with open(os.path.join(out_dir, "shuffled.json"), "w") as f:
            json.dump(seen, f)


def iterable(out_dir: str, tmp: str, mesh) -> dict:
    """An IterableDataset (accelerate's IterableDatasetShard) at dp 2 x cp 2 ring, recorded as
    dp2_cp2_ring_iterable; with dispatch_batches=True it is refused: returns that message."""
    from cp_softcap.integrations.hf_trainer import CPTrainer

    class Stream(torch.utils.data.IterableDataset):
        def __init__(self, rows):
            self.rows = rows

        def __iter__(self):
            return iter(self.rows)

    train, evaluation = data(mesh.size(0))
    messages = {}
    for dispatch in (False, True):
        targs = args(tmp, PER_DEVICE, accelerator_config={"dispatch_batches": dispatch})
        trainer = CPTrainer(model=model("cp_softcap"), args=targs, cp_mesh=mesh, train_dataset=Stream(train),
                            eval_dataset=evaluation)
        try:
            trainer.train()
        except ValueError as e:
            messages["dispatch_batches"] = str(e)
            continue
        record(trainer, out_dir, "dp2_cp2_ring_iterable")
    return messages


def refusals(out_dir: str, targs, mesh, messages: dict) -> None:
    """Trainer-level refusals: each message, on rank 0."""
    from cp_softcap.integrations.hf_trainer import CPTrainer
    train, _ = data(mesh.size(0))
    for case, attn, per_rank in (("eager_model", "eager", False), ("per_rank_tokens", "cp_softcap", True)):
        targs.average_tokens_across_devices = not per_rank
        try:
            CPTrainer(model=model(attn), args=targs, cp_mesh=mesh, train_dataset=train)
            messages[case] = None
        except ValueError as e:
            messages[case] = str(e)
    targs.average_tokens_across_devices = True
    for case, kw in (("label_smoothing", {}), ("compute_metrics", {"compute_metrics": lambda p: {}})):
        targs.label_smoothing_factor = 0.1 if case == "label_smoothing" else 0.0
        try:
            CPTrainer(model=model("cp_softcap"), args=targs, cp_mesh=mesh, train_dataset=train, **kw)
            messages[case] = None
        except ValueError as e:
            messages[case] = str(e)
    targs.label_smoothing_factor = 0.0
    trainer = CPTrainer(model=model("cp_softcap"), args=targs, cp_mesh=mesh, train_dataset=train)
    try:
        trainer.predict(train)
        messages["predict"] = None
    except ValueError as e:
        messages["predict"] = str(e)
    if targs.process_index == 0:
        with open(os.path.join(out_dir, "refusals.json"), "w") as f:
            json.dump(messages, f)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    {"ref": reference, "cp": cp_runs}[mode](out)
