"""Workers for tests_dist/test_trl_sft_dist.py: TRL SFTTrainer fine-tuning of a tiny Gemma2
(attention softcap 3 saturated by large weights, final softcap 5, window 16 shorter than the
30-70-token conversations) on examples/gemma2/sft.py's toy chat data, run two ways.

    python tests_dist/sft_workers.py ref OUT_DIR        # plain SFTTrainer / Trainer, float64, 1 process
    python -m torch.distributed.run --nproc-per-node 4 tests_dist/sft_workers.py cp OUT_DIR
    python tests_dist/fork_launch.py sft_workers OUT_DIR  # both, forked from one process (the tests)

With slow=False (fork_launch.py --no-slow: pytest's default run) the CP ranks leave out
padfree_full_compiled (SFTConfig(torch_compile=True)), which only a `slow` test reads: its
compile is about half of these runs' CPU time, and neither TRL nor CPSFTTrainer adds anything for
torch_compile to CPTrainerMixin, whose compiled training test_hf_trainer_dist.py's default run has.

Each case writes OUT_DIR/<name>.json (per logged step: loss, grad norm, TRL's metrics or
num_input_tokens_seen; eval metrics) and OUT_DIR/<name>.pt (final weights). The reference runs
one process with per-device batch dp x the CP run's, so a step sees the same global batch; the
data order is sequential except in the `odd` cases, which shuffle (Trainer's seeded sampler) a
dataset whose size the batch does not divide, for one epoch. The NEFTune case writes
OUT_DIR/[ref_]neftune.json: the bound of every NEFTune noise draw in training (per rank in the CP
run, and with Trainer's own per-shard hook as the control). Its attention is cp_softcap on one
device (packed batches need per-document attention; tests/test_hf_packed.py checks it against
eager per document).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import contextmanager

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gemma2"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_trainer_workers as HW  # noqa: E402
import sft as example  # noqa: E402  (examples/gemma2/sft.py)

# name: (dp, cp, comm, data, SFTConfig overrides)
CASES = {
    "packed_completion": (2, 2, "ring", "pc", {"packing": True}),
    "packed_assistant": (1, 4, "a2a", "chat", {"packing": True, "assistant_only_loss": True}),
    "padfree_full": (2, 2, "ring", "pc", {"padding_free": True, "completion_only_loss": False}),
    "padfree_completion_odd": (1, 4, "a2a", "pc", {"padding_free": True}),
}
PER_DEVICE, GA, STEPS = 2, 2, 3
NEFTUNE_CASE, NEFTUNE_ALPHA = "packed_assistant", 5.0     # dp 1 x cp 4: the reference's batches


def model():
    """The tiny saturating Gemma2 in float64: TRL's LM head kernel accumulates in float32 either
    way, and on this model its float32 matmuls alone move the loss by ~1e-5 (one process, float32
    against float64), which would hide the CP differences being tested."""
    return HW.model("cp_softcap").double()


def rows(kind: str, n: int, seed: int = 0):
    from datasets import Dataset
    return Dataset.from_list(example.chat_rows(n, seed, prompt_completion=kind == "pc"))


def sft_args(tmp: str, dp: int, case: str, **kw):
    odd = case.endswith("_odd")
    base = dict(per_device_train_batch_size=(4 if odd else PER_DEVICE) * dp, per_device_eval_batch_size=2,
                gradient_accumulation_steps=1 if odd else GA, max_steps=-1 if odd else STEPS,
                num_train_epochs=1, optim="sgd", learning_rate=0.05, max_grad_norm=1.0,
                dataloader_drop_last=False, assistant_only_loss=False, max_length=None, packing=False,
                include_num_input_tokens_seen="no")
    base.update(CASES[case][4])
    if base["packing"]:
        base["max_length"] = 64
    base.update(kw)
    return example.sft_config(tmp, **base)


def datasets(case: str):
    """Train and eval data: 18 shuffled rows and 7 eval rows in the odd case (neither divides
    the batch); else enough for STEPS steps and 8 eval rows."""
    kind = CASES[case][3]
    if case.endswith("_odd"):
        return rows(kind, 18), rows(kind, 7, seed=1)
    return rows(kind, 48), rows(kind, 8, seed=1)


def record(trainer, out_dir: str, name: str) -> None:
    metrics = trainer.evaluate()
    if trainer.args.process_index != 0:
        return
    keys = ("loss", "grad_norm", "mean_token_accuracy", "entropy", "num_tokens", "num_input_tokens_seen")
    steps = [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"steps": steps, "eval": {k: v for k, v in metrics.items() if isinstance(v, float)
                                            and "runtime" not in k and "per_second" not in k}}, f)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
               os.path.join(out_dir, name + ".pt"))


def trainer_cls(base, case: str):
    return base if case.endswith("_odd") else HW.sequential(base)


def sft(cls, model, args, case: str, **kw):
    train, evaluation = datasets(case)
    return trainer_cls(cls, case)(model=model, args=args, processing_class=example.toy_tokenizer(),
                                  train_dataset=train, eval_dataset=evaluation, **kw)


# CPTrainer (no TRL) at dp 1 on 18 packed documents, shuffled, batch 4, one epoch; eval 7 at batch 2
def plain_args(tmp: str, per_device: int):
    return HW.example.training_args(
        tmp, per_device_train_batch_size=per_device, gradient_accumulation_steps=1, max_steps=-1,
        num_train_epochs=1, optim="sgd", learning_rate=0.05, max_grad_norm=1.0, dataloader_drop_last=False,
        include_num_input_tokens_seen="all")


def plain_data():
    return (HW.example.text_rows(18, 32, packed=True),
            HW.example.text_rows(7, 32, seed=1, packed=True))


@contextmanager
def noise_bounds():
    """The bound b of every uniform_(-b, b) draw while it is open (NEFTune's noise is the only
    one in these training steps), as Python floats of the value passed."""
    seen, original = [], torch.Tensor.uniform_

    def recording(self, a=0.0, b=1.0, *rest, **kw):
        if float(a) == -float(b):
            seen.append(float(b))
        return original(self, a, b, *rest, **kw)
    torch.Tensor.uniform_ = recording
    try:
        yield seen
    finally:
        torch.Tensor.uniform_ = original


def neftune_args(tmp: str):
    return sft_args(tmp, 1, NEFTUNE_CASE, neftune_noise_alpha=NEFTUNE_ALPHA, max_steps=2)


def reference(out_dir: str) -> None:
    from trl import SFTTrainer
    torch.set_num_threads(1)
    for case, (dp, *_rest) in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            trainer = sft(SFTTrainer, model(), sft_args(tmp, dp, case), case)
            trainer.train()
            record(trainer, out_dir, "ref_" + case)
    train, evaluation = plain_data()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = transformers.Trainer(model=HW.model("cp_softcap").double(), args=plain_args(tmp, 4),
                                       data_collator=transformers.DataCollatorWithFlattening(),
                                       train_dataset=train, eval_dataset=evaluation)
        trainer.train()
        record(trainer, out_dir, "ref_cptrainer_odd")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = sft(SFTTrainer, model(), neftune_args(tmp), NEFTUNE_CASE)
        with noise_bounds() as bounds:
            trainer.train()
    with open(os.path.join(out_dir, "ref_neftune.json"), "w") as f:
        json.dump({"bounds": bounds}, f)


def drop_boundaries(collator):
    """Negative control: the padding-free row as ONE sequence (documents attend to each other)."""
    def collate(features):
        batch = collator(features)
        for key in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
            batch.pop(key, None)
        return batch
    return collate


def cp_runs(out_dir: str, slow: bool = True) -> None:
    from cp_softcap.integrations.hf_trainer import CPTrainer, cp_mesh
    from cp_softcap.integrations.trl_sft import CPSFTTrainer
    torch.set_num_threads(1)
    meshes = {cp: cp_mesh(cp) for cp in (2, 4)}
    with tempfile.TemporaryDirectory() as tmp:
        for case, (dp, cp, comm, _, _) in CASES.items():
            trainer = sft(CPSFTTrainer, model(), sft_args(tmp, 1, case), case,
                          cp_mesh=meshes[cp], cp_comm=comm)
            trainer.train()
            record(trainer, out_dir, case)
        for control in ("no_boundaries", "per_rank"):
            case = "packed_assistant" if control == "no_boundaries" else "packed_completion"
            dp, cp, comm = CASES[case][:3]
            trainer = sft(CPSFTTrainer, model(), sft_args(tmp, 1, case), case,
                          cp_mesh=meshes[cp], cp_comm=comm)
            if control == "no_boundaries":
                trainer.data_collator.collator = drop_boundaries(trainer.data_collator.collator)
            else:            # each rank's loss over its own tokens
                trainer.args.average_tokens_across_devices = False
            trainer.train()
            trainer.args.average_tokens_across_devices = True
            record(trainer, out_dir, f"{case}_{control}")
        if slow:
            # SFTConfig(torch_compile=True): the model compiled by the trainer (aot_eager here, as
            # in hf_trainer_workers.py), padding-free rows at dp 2 x cp 2
            case = "padfree_full"
            trainer = sft(CPSFTTrainer, model(), sft_args(tmp, 1, case, torch_compile=True,
                                                         torch_compile_backend="aot_eager"), case,
                          cp_mesh=meshes[CASES[case][1]], cp_comm=CASES[case][2])
            trainer.train()
            record(trainer, out_dir, f"{case}_compiled")
        train, evaluation = plain_data()
        trainer = CPTrainer(model=HW.model("cp_softcap"), args=plain_args(tmp, 4), cp_mesh=meshes[4],
                            data_collator=transformers.DataCollatorWithFlattening(), train_dataset=train,
                            eval_dataset=evaluation)
        trainer.train()
        record(trainer, out_dir, "cptrainer_odd")
    resumed(out_dir, meshes[2])
    refusals(out_dir, meshes[2])
    neftune(out_dir, meshes[CASES[NEFTUNE_CASE][1]])
    example.main(["--steps", "2"])           # the example as README runs it (dp 2 x cp 2, ring, packed)


def resumed(out_dir: str, mesh) -> None:
    """packed_completion saved at step 2, then a new trainer resumed from that checkpoint."""
    from cp_softcap.integrations.trl_sft import CPSFTTrainer
    case, ckpt = "packed_completion", os.path.join(out_dir, "ckpt")
    first = sft_args(ckpt, 1, case, save_strategy="steps", save_steps=2, max_steps=2)
    sft(CPSFTTrainer, model(), first, case, cp_mesh=mesh).train()
    trainer = sft(CPSFTTrainer, model(), sft_args(ckpt, 1, case), case, cp_mesh=mesh)
    trainer.train(resume_from_checkpoint=os.path.join(ckpt, "checkpoint-2"))
    record(trainer, out_dir, case + "_resumed")


def neftune(out_dir: str, mesh) -> None:
    """NEFTune at dp 1 x cp 4: the noise bounds each rank draws with, through CPSFTTrainer.train
    and (the control, the behaviour before the fix) through Trainer.train with HF's own hook,
    which takes the shard's length; gathered to rank 0."""
    import torch.distributed as dist

    from cp_softcap.integrations.hf_trainer import CPTrainerMixin
    from cp_softcap.integrations.trl_sft import CPSFTTrainer
    comm = CASES[NEFTUNE_CASE][2]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, train in (("cp", lambda t: t.train()),
                            ("per_shard", lambda t: super(CPTrainerMixin, t).train())):
            trainer = sft(CPSFTTrainer, model(), neftune_args(tmp), NEFTUNE_CASE, cp_mesh=mesh, cp_comm=comm)
            with noise_bounds() as bounds:
                train(trainer)
            assert trainer.neftune_noise_alpha == NEFTUNE_ALPHA      # restored after train()
            runs[name] = [None] * dist.get_world_size()
            dist.all_gather_object(runs[name], bounds)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "neftune.json"), "w") as f:
            json.dump(runs, f)


def refusals(out_dir: str, mesh) -> None:
    """Construction-time refusals, each message on rank 0."""
    from cp_softcap.integrations.trl_sft import CPSFTTrainer
    messages = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in (("padded_rows", {"packing": False, "padding_free": False}),
                         ("compute_metrics", {})):
            extra = {"compute_metrics": lambda p: {}} if name == "compute_metrics" else {}
            try:
                sft(CPSFTTrainer, model(), sft_args(tmp, 1, "padfree_full", **kw), "padfree_full",
                    cp_mesh=mesh, **extra)
                messages[name] = None
            except ValueError as e:
                messages[name] = str(e)
    if mesh.get_rank() == 0:
        with open(os.path.join(out_dir, "refusals.json"), "w") as f:
            json.dump(messages, f)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    {"ref": reference, "cp": cp_runs}[mode](out)
