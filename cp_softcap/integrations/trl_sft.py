"""TRL's `SFTTrainer` with context parallelism: CPTrainerMixin composed with SFTTrainer, TRL's own
training loop, dataset preparation (chat templates, packing, completion/assistant masks) and
collator, for an `attn_implementation="cp_softcap"` model (Gemma2).

    from trl import SFTConfig
    from cp_softcap.integrations.trl_sft import CPSFTTrainer, cp_mesh
    args = SFTConfig(..., packing=True)                  # or padding_free=True
    mesh = cp_mesh(cp=2)                                  # (dp, cp) over the world
    trainer = CPSFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=ds,
                           cp_mesh=mesh, cp_comm="ring")
    trainer.train()

What it adds to CPTrainerMixin (hf_trainer.py), which shards TRL's padding-free batches (one row,
position_ids restarting at each document) into the packed layout balanced for every layer kind:
- metrics: TRL sums its per-token counts (valid labels, correct top-1, entropy) over the ranks
  with accelerate's gather_for_metrics, which at the end of an epoch keeps only as many entries
  as there are leftover samples; here each count is summed over the whole world (every CP shard of
  every dp group), so mean_token_accuracy and entropy are those of the global batch.
  `num_tokens` counts each dp group's real tokens once (not the packed layout's end padding).
- evaluation: through TRL's compute_loss with the CP group's label count, so eval_loss is the
  batch's token mean and TRL's eval metrics are logged, as on one process.
Refused at construction, with the reason: padded rows (padding_free=False without BFD packing:
their attention mask cannot be applied by CP attention), a vision dataset, use_liger_kernel,
a MoE auxiliary loss, and everything CPTrainer refuses.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

try:
    from trl import SFTTrainer
except ImportError as e:
    raise ImportError("cp_softcap.integrations.trl_sft needs TRL: pip install 'trl==1.16.0' "
                      "(or pip install -e \".[sft]\")") from e

from .hf_trainer import CPTrainerMixin, cp_mesh

__all__ = ["CPSFTTrainer", "cp_mesh"]


class CPSFTTrainer(CPTrainerMixin, SFTTrainer):
    """trl.SFTTrainer with context parallelism. Takes SFTTrainer's arguments plus `cp_mesh`
    (cp_mesh()), `cp_comm` and `cp_backend` (CPTrainerMixin)."""

    def _check_setup(self) -> None:
        args, problems = self.args, []
        if not self.padding_free:
            problems.append(
                "padded rows (SFTConfig padding_free=False and packing off or packing_strategy='wrapped') "
                "carry an attention mask with padding, which context-parallel attention cannot apply; set "
                "SFTConfig(packing=True) (BFD packing, padding-free) or padding_free=True")
        if getattr(self, "_is_vision_dataset", False):
            problems.append("vision-language datasets are not supported (their collator pads rows with an "
                            "attention mask); use a text dataset")
        if args.use_liger_kernel:
            problems.append("use_liger_kernel computes the loss in Liger's kernel, outside the sharded labels "
                            "and the global token count; set use_liger_kernel=False")
        if getattr(self, "aux_loss_enabled", False):
            problems.append("the MoE auxiliary loss is a per-rank mean of the shard's router logits; set "
                            "router_aux_loss_coef=0 or use a dense model")
        if problems:
            raise ValueError(f"CPSFTTrainer (global rank {args.process_index}): " + "; ".join(problems))
        super()._check_setup()

    @contextmanager
    def _counts_summed_over_world(self):
        """TRL's compute_loss gathers scalar counts with gather_for_metrics and sums them: make
        that a sum over every rank, with no end-of-epoch trimming (which would drop CP shards)."""
        def summed(value, use_gather_object=False):
            total = torch.as_tensor(value).detach().clone().reshape(1)
            if self.args.world_size > 1:
                dist.all_reduce(total)
            return total
        self.accelerator.gather_for_metrics = summed
        try:
            yield
        finally:
            del self.accelerator.gather_for_metrics

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = self.model.training
        before = self._total_train_tokens
        with self._counts_summed_over_world():
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
        if training:
            self._total_train_tokens = before + self.global_real_tokens(inputs)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return out

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        if "shift_labels" not in inputs:
            raise ValueError("CPSFTTrainer evaluates the loss only and needs labels in the eval batches")
        group = self.cp_mesh.get_group("cp")
        with torch.no_grad():
            count = inputs["shift_labels"].ne(-100).sum()
            if self.cp_size > 1:
                dist.all_reduce(count, group=group)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=count).detach()
            # TRL scales a loss normalised by a global count by the world size, for DDP's gradient
            # average; an evaluation loss is not averaged, so undo it, then sum the CP shards
            loss = loss / self.args.world_size
            if self.cp_size > 1:
                dist.all_reduce(loss, group=group)
        return loss, None, None
