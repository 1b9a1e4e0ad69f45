"""HF `Trainer` with context parallelism: a dp x cp run of an `attn_implementation="cp_softcap"`
model, with Trainer's own training loop.

    import torch.distributed as dist
    from cp_softcap.integrations.hf_trainer import CPTrainer, cp_mesh
    args = TrainingArguments(...)          # under torchrun: initialises torch.distributed
    mesh = cp_mesh(cp=2)                   # DeviceMesh (dp, cp) over the world, cp on adjacent ranks
    model = Gemma2ForCausalLM.from_pretrained(path, attn_implementation="cp_softcap")
    trainer = CPTrainer(model=model, args=args, train_dataset=ds, cp_mesh=mesh, cp_comm="ring")
    trainer.train()

What CPTrainer changes, each through a Trainer or accelerate hook (docs/hf_trainer.md):
- data: the DataLoaders accelerate prepares are sharded over the dp ranks only (its
  BatchSamplerShard gets dp size and dp rank), so all CP ranks of a dp group read the same batch;
  the collator is wrapped in `CPCollator`, which shifts the labels on the FULL sequence, then keeps
  this rank's shard of input_ids and labels and adds its position_ids: the zigzag shard for one
  sequence per row, the packed layout for packed documents (DataCollatorWithFlattening, TRL's
  padding-free collator), whose GLOBAL boundaries go to the model as `cu_seqlens`.
  At dp 1 a short last batch stays short (accelerate would complete it from the start of the
  epoch), as on one process; num_input_tokens_seen counts real tokens, not the layout's padding.
- loss: Trainer counts the valid labels of the sharded batches and sums the counts over the world
  (`average_tokens_across_devices=True`, required), so every rank's loss is its cross-entropy sum
  divided by the GLOBAL count; Trainer scales it by the world size, which cancels DDP's average:
  the gradients are summed over cp and averaged over dp, the loss equals the one-process loss.
- evaluation: loss only (the logits are sharded); each dp group's batch loss is its token mean,
  as in a one-process evaluation with the same per-device batch size, gathered over dp only.
- NEFTune (`neftune_noise_alpha`): HF bounds the embedding noise by alpha / sqrt(L * d) with L
  the length of the embedding output, which under CP is the rank's shard (sqrt(cp) too much
  noise); CPTrainer bounds it with the batch's GLOBAL length instead (the length one process
  sees for the same batch: the packed stream without the layout's end padding, or cp x the
  zigzag shard), so the noise has the magnitude of a one-process run.

Refused with a message naming the fix: cp that does not divide the world, a model whose attention
does not route through cp_softcap, a padding attention mask, packed documents spread over several
rows or not starting at position 0, unpacked lengths that 2 * cp does not divide, accelerate's
own CP/SP/TP, per-rank token averaging, a MoE load-balancing loss (config.output_router_logits with
a router_aux_loss_coef: a function of the whole batch's routing), label smoothing, a custom
compute_loss_func, compute_metrics
(and predict(): the logits are sharded, evaluation is loss only), dispatched batches.
"""
from __future__ import annotations

import os
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from accelerate.data_loader import IterableDatasetShard
from transformers import Trainer

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"cp_softcap.integrations.hf_trainer needs transformers >= 5 (Trainer's "
                      f"num_items_in_batch and parallelism hooks); found {transformers.__version__}. "
                      "pip install -U 'transformers>=5' accelerate")

from ..documents import boundaries_from_positions, packed_layout
from ..sharding import fits_zigzag, positions, shard
from .hf import cp_softcap_attention, hf_window, mask_is_empty, use_cp_group

_TOKEN_KEYS = ("input_ids", "labels", "shift_labels")


def cp_mesh(cp: int, *, device_type: Optional[str] = None):
    """DeviceMesh (dp, cp) over the whole world, dims named "dp" and "cp", cp on adjacent ranks
    (ranks r and r + 1 share a dp group when cp > 1). Initialises torch.distributed from the
    torchrun environment when it is not yet (TrainingArguments usually has done it)."""
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or world % cp:
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
        divisors = [c for c in range(1, world + 1) if world % c == 0]
        raise ValueError(f"cp={cp!r} does not divide the world of {world} ranks (rank {rank}); "
                         f"the mesh is dp x cp with dp = world / cp: use cp in {divisors}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if world == 1 and not dist.is_initialized():     # one process: a mesh needs a process group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))


def layer_windows(config) -> Optional[list]:
    """The attention windows of a model's layer kinds, as packed_layout(layer_windows=) takes
    them, for configs with `sliding_window` and `layer_types` (Gemma2: "full_attention" and
    "sliding_attention", the window the attention function applies: hf_window); None when
    every layer attends alike (then the layout is balanced for causal attention)."""
    sw, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None) or ()
    if not sw:
        return None
    windows = {None if t == "full_attention" else hf_window(sw) for t in types
               if t in ("full_attention", "sliding_attention")}
    return sorted(windows, key=str) if len(windows) > 1 else None


def shard_batch(batch: dict, cp: int, rank: int, layer_windows: Optional[list] = None) -> dict:
    """A collated causal-LM batch (input_ids [B, S], labels [B, S] as HF takes them, unshifted)
    -> this CP rank's shard: input_ids, labels == shift_labels (shifted on the full sequence, then
    sharded) and position_ids. cp == 1 gives the same keys unsharded, so a one-process run sees
    the same loss inputs.

    Unpacked (one sequence per row): the zigzag shard [B, S/cp] and global positions; one row
    whose length 2 * cp does not divide is taken as one packed document (below).
    Packed (one row of documents whose position_ids restart at 0, as DataCollatorWithFlattening
    and padding-free collators emit; or cu_seq_lens_q): the packed layout's shard
    [1, packed_len(S, cp) / cp] of the stream padded at its end, document-relative positions, and
    `cu_seqlens`: the PackedLayout of the GLOBAL boundaries (`.cu_seqlens`), identical on every
    rank, balanced for causal attention or, with layer_windows (layer_windows(model.config)),
    for every layer kind at once; the model passes it on to cp_softcap's attention."""
    batch = dict(batch)
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(ids.shape)}")
    b, s = ids.shape
    _check_mask(batch.pop("attention_mask", None))
    cu = _documents(batch, b, s)
    if cu is None and b == 1 and not fits_zigzag(s, cp):
        # one sequence whose length zigzag cannot split (e.g. a flattened batch holding a single
        # document, whose positions are a plain range): the packed layout of one document takes
        # any length and is exact
        cu = [0, s]
    _check_other_keys(batch, b, s)
    shifted = batch.pop("shift_labels", None)
    labels = batch.pop("labels", None)
    if shifted is None and labels is not None:
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)   # HF's causal shift, on the full sequence
    out = dict(batch)
    if cu is None and cp == 1:          # nothing to split: any length
        pos = torch.arange(s, device=ids.device)
    elif cu is None:
        _check_length(s, cp, rank)
        out["input_ids"] = shard(ids, cp, rank).contiguous()
        pos = positions(s, cp, rank, device=ids.device)
    else:
        docs = packed_layout(cu, s, cp, layer_windows=layer_windows)
        out["input_ids"] = shard(ids, cp, rank, cu_seqlens=docs).contiguous()
        pos = positions(s, cp, rank, device=ids.device, cu_seqlens=docs)
        out["cu_seqlens"] = docs
        if shifted is not None:
            shifted = shard(shifted, cp, rank, cu_seqlens=docs, pad_value=-100)
    if shifted is not None:
        if cu is None and cp > 1:
            shifted = shard(shifted, cp, rank)
        # labels must be non-None for HF to compute a loss; shift_labels stops HF shifting the shard
        out["labels"] = out["shift_labels"] = shifted.contiguous()
    out["position_ids"] = pos[None].expand(b, -1).contiguous()
    return out


def _check_length(s: int, cp: int, rank: int) -> None:
    if not fits_zigzag(s, cp):
        raise ValueError(
            f"sequence length {s} of this batch is not a multiple of 2 * cp = {2 * cp} (CP rank {rank}): "
            "the zigzag layout splits it into 2 * cp equal chunks. Pad every batch to a multiple of "
            f"{2 * cp} (e.g. the tokenizer's or collator's pad_to_multiple_of={2 * cp}, or "
            f"cp_softcap.sharding.pad_to_multiple(x, {2 * cp}) with labels -100) without an attention "
            "mask, or pack the documents (DataCollatorWithFlattening), which takes any length")


def _documents(batch: dict, b: int, s: int):
    """The global document boundaries [0, ..., s] of a packed batch, or None for an unpacked one.
    Removes the packing keys (position_ids, cu_seq_lens_*, max_length_*, seq_idx): the shard gets
    its own positions, and per-rank boundaries would be wrong under CP."""
    pos = batch.pop("position_ids", None)
    cu_q, cu_k = batch.pop("cu_seq_lens_q", None), batch.pop("cu_seq_lens_k", None)
    for key in ("max_length_q", "max_length_k", "seq_idx"):
        batch.pop(key, None)
    if cu_q is not None:
        if cu_k is not None and not torch.equal(torch.as_tensor(cu_q), torch.as_tensor(cu_k)):
            raise ValueError("the batch has cu_seq_lens_q != cu_seq_lens_k; packed documents need "
                             "queries and keys over the same stream")
        cu = [int(x) for x in torch.as_tensor(cu_q).flatten()]
    elif pos is not None:
        pos = torch.as_tensor(pos).reshape(-1, s)
        if bool((pos == torch.arange(s, device=pos.device)).all()):
            return None     # plain positions, recomputed per shard
        found = boundaries_from_positions(pos[:1], 1)
        cu = [0, s] if found is None else list(found)
    else:
        return None
    if b != 1 or cu[0] != 0 or cu[-1] != s:
        raise ValueError(
            f"packed batch of shape {(b, s)} with document boundaries {cu[:6]}...: CPTrainer takes packed "
            "documents as ONE row covering the whole stream (DataCollatorWithFlattening's layout); "
            "pack each batch into one row, or use one document per row without position_ids")
    if pos is not None:
        from ..documents import doc_positions
        expected = doc_positions(tuple(cu), torch.arange(s, device=pos.device))
        if not bool((pos == expected).all()):
            raise ValueError(
                f"the packed batch's position_ids (starting {pos[0, :8].tolist()}) are not 0, 1, ... within "
                f"each document of the boundaries {cu[:6]}...; cp_softcap gives each rank document-relative "
                "positions, so documents must start at position 0")
    return cu


def _check_mask(mask) -> None:
    if mask is not None and not isinstance(mask, torch.Tensor):
        mask = torch.as_tensor(mask)
    if mask_is_empty(mask):
        return
    # zeros mean padding only in a 2-D mask; any other shape is refused even when all ones
    what = ("with padding (zeros)" if mask.dim() == 2 else
            f"of {mask.dim()} dimensions (only a 2-D all-ones mask is accepted)")
    raise ValueError(
        f"the batch has an attention_mask {tuple(mask.shape)} {what}; context-parallel "
        "attention applies only causal and sliding-window masks. Right padding needs no mask: give the "
        "pad positions labels -100 and drop attention_mask (e.g. remove it in the collator).")


def _check_other_keys(batch: dict, b: int, s: int) -> None:
    for key, value in batch.items():
        if key in _TOKEN_KEYS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 2 and tuple(value.shape[:2]) == (b, s):
            raise ValueError(f"the batch has a per-token tensor {key!r} {tuple(value.shape)} that "
                             "CPTrainer does not know how to shard; remove it in the collator")


def real_tokens(batch: dict, rank: int) -> torch.Tensor:
    """bool, the shape of this CP rank's input_ids: True for the tokens of the user's batch, False
    for the end padding the packed layout adds (`cu_seqlens`, a PackedLayout from shard_batch)."""
    ids, layout = batch["input_ids"], batch.get("cu_seqlens")
    if layout is None or not hasattr(layout, "index"):
        return torch.ones_like(ids, dtype=torch.bool)
    return (layout.index(rank, device=ids.device) < layout.cu_seqlens[-1]).expand_as(ids)


class _UnpaddedIterableShard(IterableDatasetShard):
    """accelerate's IterableDatasetShard at dp 1: the stream as it is, a partial last batch kept
    partial, as on one process (the DataLoader still applies drop_last)."""

    def __iter__(self):
        yield from self.dataset


class CPCollator:
    """Wraps a data collator: collate with it, then keep this CP rank's shard (shard_batch)."""

    def __init__(self, collator, cp: int, rank: int, layer_windows: Optional[list] = None):
        self.collator, self.cp, self.rank, self.layer_windows = collator, cp, rank, layer_windows

    def __call__(self, features):
        return shard_batch(self.collator(features), self.cp, self.rank, self.layer_windows)


def global_seq_len(batch: dict, cp: int) -> int:
    """The sequence length one process sees for the batch that `batch` is a CP rank's shard of
    (shard_batch's output): the packed stream's length without the layout's end padding, or
    cp x the zigzag shard's length (the zigzag adds no padding)."""
    layout = batch.get("cu_seqlens")
    if hasattr(layout, "cu_seqlens"):
        return int(layout.cu_seqlens[-1])
    return batch["input_ids"].size(1) * cp


def neftune_global_hook(module, input, output, *, alpha: float, seq_len: int):
    """transformers' neftune_post_forward_hook with the sequence length given instead of read
    from the (sharded) output: uniform noise in +-alpha / sqrt(seq_len * hidden), the bound
    computed as HF computes it (float32), so it equals the one-process bound bit for bit."""
    if module.training:
        bound = alpha / torch.sqrt(torch.tensor(seq_len * output.size(2)))
        output = output + torch.zeros_like(output).uniform_(-bound, bound)
    return output


def input_embeddings(model):
    """The embedding module HF's activate_neftune hooks (PEFT models: the base model's)."""
    from transformers.trainer_utils import _is_peft_model
    if _is_peft_model(model):
        return model.base_model.model.get_input_embeddings()
    return model.get_input_embeddings()


def check_cp_model(model) -> None:
    """Raise unless every attention of `model` goes through cp_softcap's registered function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    model = getattr(model, "module", model)
    configs = [model.config] + [getattr(model.config, k) for k in getattr(model.config, "sub_configs", {})]
    for config in configs:
        name = getattr(config, "_attn_implementation", None)
        if name is None:
            continue
        if ALL_ATTENTION_FUNCTIONS.get(name) is not cp_softcap_attention:
            raise ValueError(
                f"{type(model).__name__} runs attention with attn_implementation={name!r}, which does not "
                "route through cp_softcap, so its attention would not be context parallel. Load it with "
                "attn_implementation='cp_softcap' (import cp_softcap.integrations.hf first) or call "
                "model.set_attn_implementation('cp_softcap').")


class CPTrainerMixin:
    """Mix into a Trainer class (first base) for dp x cp training: `cp_mesh` is the (dp, cp)
    DeviceMesh from cp_mesh(); `cp_comm` the CP algorithm ("ring", "all_gather", "a2a", "auto")
    and `cp_backend` the kernel, as for cp_softcap.integrations.hf.use_cp_group."""

    def __init__(self, *args, cp_mesh, cp_comm: str = "ring", cp_backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        if tuple(cp_mesh.mesh_dim_names or ()) != ("dp", "cp"):
            raise ValueError(f"cp_mesh must be a 2-D DeviceMesh with dims ('dp', 'cp') (cp_mesh()), "
                             f"got dims {cp_mesh.mesh_dim_names}")
        self.cp_mesh = cp_mesh
        self.cp_size, self.cp_rank = cp_mesh.size(1), cp_mesh.get_local_rank("cp")
        self.dp_size, self.dp_rank = cp_mesh.size(0), cp_mesh.get_local_rank("dp")
        self._check_setup()
        check_cp_model(self.model)
        use_cp_group(cp_mesh.get_group("cp") if self.cp_size > 1 else None, comm=cp_comm,
                     backend=cp_backend)
        self.data_collator = CPCollator(self.data_collator, self.cp_size, self.cp_rank,
                                        layer_windows(self.model.config))

    def _check_setup(self) -> None:
        args, world = self.args, self.cp_mesh.size()
        problems = []
        if world != args.world_size:
            problems.append(f"cp_mesh spans {world} ranks but Trainer runs on {args.world_size}")
        if self.get_cp_size() * self.get_sp_size() * self.get_tp_size() != 1:
            problems.append("accelerate's parallelism_config sets cp/sp/tp > 1: use one CP mechanism")
        if not args.average_tokens_across_devices:
            problems.append("average_tokens_across_devices=False normalises the loss per rank; set it True")
        if not self.model_accepts_loss_kwargs:
            problems.append("the model does not take num_items_in_batch, so the loss cannot be "
                            "normalised by the global token count")
        config = getattr(self.model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        coef = getattr(text, "router_aux_loss_coef", 0.0)
        if self.cp_size > 1 and getattr(text, "output_router_logits", False) and coef:
            problems.append(f"the model adds a MoE load-balancing loss (config.output_router_logits=True, "
                            f"router_aux_loss_coef={coef}), which each CP rank would compute from the routing "
                            "of its shard of the tokens instead of the whole batch's; set "
                            "model.config.output_router_logits = False")
        if args.label_smoothing_factor or self.compute_loss_func is not None:
            problems.append("label smoothing / compute_loss_func see sharded logits without the global "
                            "token count; leave them unset")
        if self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None:
            problems.append("compute_metrics / preprocess_logits_for_metrics need the full logits, but "
                            "each CP rank holds a shard of them and CPTrainer evaluates the loss only; "
                            "leave them unset (evaluate() reports eval_loss) and compute metrics with a "
                            "plain Trainer on one process")
        if problems:
            raise ValueError(f"CPTrainer (global rank {args.process_index}): " + "; ".join(problems))

    # ---- NEFTune: noise bounded by the global sequence length, not the shard's
    def train(self, *args, **kwargs):
        """Trainer.train; with neftune_noise_alpha at cp > 1, Trainer's NEFTune hook (bounded by
        the shard's length) is replaced by one per training step bounded by the global length."""
        alpha = self.neftune_noise_alpha
        if alpha is None or self.cp_size == 1:
            return super().train(*args, **kwargs)
        self._cp_neftune_alpha, self.neftune_noise_alpha = alpha, None
        try:
            return super().train(*args, **kwargs)
        finally:
            self.neftune_noise_alpha, self._cp_neftune_alpha = alpha, None

    def training_step(self, model, inputs, *args, **kwargs):
        alpha = getattr(self, "_cp_neftune_alpha", None)
        if alpha is None:
            return super().training_step(model, inputs, *args, **kwargs)
        # the hook lives for this step's forward and backward only (any recompute included)
        embeddings = input_embeddings(self.accelerator.unwrap_model(model))
        handle = embeddings.register_forward_hook(
            partial(neftune_global_hook, alpha=alpha, seq_len=global_seq_len(inputs, self.cp_size)))
        try:
            return super().training_step(model, inputs, *args, **kwargs)
        finally:
            handle.remove()

    # ---- data: one batch per dp group, sharded over its CP ranks by the collator
    def get_train_dataloader(self):
        return self._shard_over_dp(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._shard_over_dp(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._shard_over_dp(super().get_test_dataloader(test_dataset))

    def _shard_over_dp(self, loader):
        """Point accelerate's per-process sharding at the dp rank instead of the global rank (as
        Trainer itself does for its rank-aware BatchRebalanceSampler)."""
        from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
        if self.args.world_size == 1:
            return loader
        if isinstance(loader, DataLoaderDispatcher):
            raise ValueError("CPTrainer needs each rank to load its own batches: set "
                             "TrainingArguments(accelerator_config={'dispatch_batches': False})")
        sampler, dataset = getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)
        target = sampler if isinstance(sampler, BatchSamplerShard) else dataset
        if not isinstance(target, (BatchSamplerShard, IterableDatasetShard)):
            raise ValueError(f"CPTrainer cannot shard a {type(loader).__name__} over dp ranks: it needs "
                             "the DataLoader that accelerate prepares (BatchSamplerShard or "
                             "IterableDatasetShard)")
        target.num_processes, target.process_index = self.dp_size, self.dp_rank
        if self.dp_size == 1:
            # one process never completes a partial last batch with samples from the start of
            # the epoch, so at dp 1 (every rank in one CP group) nothing may: keep it partial
            if isinstance(target, BatchSamplerShard):
                target.even_batches = False
            elif not target.drop_last:
                target.__class__ = _UnpaddedIterableShard
        return loader

    def _track_num_input_tokens(self, inputs):
        """num_input_tokens_seen as one process counts it: the real tokens of every dp group's
        batch, not the end padding of the packed layout, each CP group counted once."""
        mode = self.args.include_num_input_tokens_seen
        if mode == "no":
            return
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        self.state.num_input_tokens_seen += self.global_real_tokens(
            inputs, pad_id if mode == "non_padding" else None)

    def global_real_tokens(self, inputs, pad_id=None) -> int:
        """Tokens of every dp group's batch, summed over the world (each token lives on one CP
        rank): not the packed layout's end padding, nor `pad_id` tokens when given."""
        real = real_tokens(inputs, self.cp_rank)
        if pad_id is not None:
            real = real & (inputs["input_ids"] != pad_id)
        count = real.sum().to(device=self.args.device, dtype=torch.int64)
        if dist.is_initialized() and self.args.world_size > 1:
            dist.all_reduce(count)
        return int(count)

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self.dp_size

    def predict(self, *args, **kwargs):
        raise ValueError("CPTrainer.predict() would return no predictions: each CP rank holds a shard of "
                         "the logits and CPTrainer evaluates the loss only. Use evaluate() for the loss, "
                         "or predict with a plain Trainer on one process")

    # ---- evaluation: the dp group's token-mean loss on every CP rank, gathered over dp only
    def evaluation_loop(self, *args, **kwargs):
        # Trainer resets gather_function after every evaluation loop: set it for each one
        self.gather_function = self._gather_over_dp
        return super().evaluation_loop(*args, **kwargs)

    def _gather_over_dp(self, losses):
        """The evaluation loop's gather of per-sample losses: over the dp ranks of this CP rank
        (its CP peers hold the same losses), then accelerate's trim of the last, partly repeated
        batch to the real samples, which counts one entry per sample and dp rank."""
        if self.dp_size > 1:
            parts = [torch.empty_like(losses) for _ in range(self.dp_size)]
            dist.all_gather(parts, losses.contiguous(), group=self.cp_mesh.get_group("dp"))
            losses = torch.cat(parts)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            losses = losses[:state.remainder]
        return losses

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        if "shift_labels" not in inputs:
            raise ValueError("CPTrainer evaluates the loss only and needs labels in the eval batches")
        with torch.no_grad():
            count = inputs["shift_labels"].ne(-100).sum()
            group = self.cp_mesh.get_group("cp")
            if self.cp_size > 1:
                dist.all_reduce(count, group=group)
            with self.compute_loss_context_manager():
                loss = model(**inputs, num_items_in_batch=count).loss.detach()
            if self.cp_size > 1:
                dist.all_reduce(loss, group=group)
        return loss, None, None


class CPTrainer(CPTrainerMixin, Trainer):
    """transformers.Trainer with context parallelism (CPTrainerMixin). For another Trainer class
    (e.g. TRL's SFTTrainer): `class CPSFTTrainer(CPTrainerMixin, SFTTrainer): pass`."""
