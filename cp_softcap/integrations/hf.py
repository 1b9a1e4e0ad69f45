"""HF transformers integration: `attn_implementation="cp_softcap"`.

Importing this module registers `cp_softcap_attention` with `transformers.AttentionInterface`
under the name "cp_softcap". Any model that hands its attention function `scaling`, `softcap`
and `sliding_window` (Gemma2 does) then runs softcapped, windowed attention through cp_softcap:
on one device, or context-parallel when a CP process group is set:

    import cp_softcap as cps
    from cp_softcap.integrations.hf import use_cp_group
    model = Gemma2ForCausalLM.from_pretrained(path, attn_implementation="cp_softcap")
    use_cp_group(cp_group)                                   # or pass cp_group=... to forward
    # comm="all_gather" | "a2a" | "auto" | "a2a+p2p" (group: cps.make_hybrid_groups(cp_group, a))
    ids = cps.sharding.shard(input_ids, cp, rank)            # [B, S/cp] zigzag shard
    pos = cps.sharding.positions(S, cp, rank)[None]          # global position ids (required)
    lab = cps.sharding.shard(labels_shifted_on_full_sequence, cp, rank)
    out = model(input_ids=ids, position_ids=pos, labels=lab, shift_labels=lab,
                num_items_in_batch=n_valid)

`out.logits` is this rank's shard; `out.loss` is the local CE sum / n_valid, so summing losses and
gradients over the CP group gives the full-sequence result. Pass `shift_labels` (labels already
shifted on the full sequence, then sharded; `labels` must be non-None for HF to compute a loss):
HF's own shift of `labels` alone would cross shard borders.

Packed batches (padding-free training: transformers' DataCollatorWithFlattening, TRL's
padding_free): on one device the document boundaries come from, in this order, a `cu_seqlens=`
model kwarg (the boundaries of every batch row, as under CP), the `cu_seq_lens_q`/`cu_seq_lens_k`
kwargs HF forwards from such collators (over the batch rows joined into one stream), or the
resets of `position_ids` (a new document wherever the position does not grow by 1, and at each
batch row; the rows joined). Each document attends only to itself (Gemma2's sliding window stays
inside its document); nothing is padded per document.
Under CP every rank holds only its shard, whose position resets cannot give the GLOBAL
boundaries: pass them yourself, `model(..., cu_seqlens=cu_global)` (identical on every rank; the
shards and positions from cps.sharding.shard / positions(..., cu_seqlens=cu_global)); they go to
cps.cp_attention(..., cu_seqlens=cu_global) exactly as CPAttention.forward(q, k, v,
cu_seqlens=cu) takes them. Without them a packed shard is refused (its positions are not the
zigzag positions).

Masks: causal and sliding-window masking happen inside cp_softcap from global positions; no
[S, S] mask is ever materialised. HF would silently DROP a user's 2-D padding mask for an
attention implementation it has no mask function for, so a mask function is registered too
(`_mask_function`): it returns None for no mask or an all-ones mask and refuses padding masks
and model-specific mask changes (under torch.compile the 2-D mask goes on to the library's
operator, which refuses a padding mask there with the same error). A dense 4-D mask reaches
the attention function and is refused there, as is attention dropout.

Keywords: the attention function implements `scaling`, `softcap`, `sliding_window`,
`is_causal`, `s_aux` (gpt-oss's learned attention sinks, [Hq]: passed to the library as
`sinks=`), the packed-document keys above (`cu_seqlens`, `cu_seq_lens_q`/`_k`, with
`max_length_q`/`_k` and `seq_idx`, which describe the same documents), `position_ids` and
`cp_group`; it accepts `dropout=0.0` and the keys HF passes through every layer that do not
change attention (`num_items_in_batch`, `shift_labels`, `output_attentions` (no weights are
returned), `output_hidden_states`, `output_router_logits`, `use_cache`, `cache_position`,
`return_dict`). Any other keyword with a value other than None is refused with a ValueError
naming it (a model whose attention needs something this function does not implement gets an
error, never a silently different result).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..api import attention, compiling, cp_attention
from ..compiled import compiled_attention, group_names
from ..documents import boundaries_from_positions
from ..groups import check_member, resolve_groups
from ..plan_cache import boundary_values, weak
from ..selector import check_backend
from ..sharding import check_positions
from ..spec import check_comm, different_boundaries_error, mask_is_empty, padding_mask_error

NAME = "cp_softcap"
_CONFIG = {"group": None, "comm": "ring", "backend": "auto"}


def use_cp_group(group, *, comm: str = "ring", backend: str = "auto") -> None:
    """Set the CP process group (None = one device), CP algorithm and kernel used by every
    `attn_implementation="cp_softcap"` call (a call's `cp_group=` replaces only the group).

    comm: "ring" | "all_gather" | "a2a" | "a2a+p2p" | "auto", as for cp_softcap.CPAttention.
    For "a2a+p2p" the group is the pair (a2a_group, ring_group) from
    cp_softcap.make_hybrid_groups(cp_group, a2a_size), or a 2-D DeviceMesh (ring, a2a)."""
    check_comm(comm)
    check_backend(backend)
    held = None
    if group is not None:
        # a pair without a2a+p2p, or a2a+p2p without one, raises here. The resolved process
        # groups (a DeviceMesh stands for its groups) are held weakly: a strong reference here
        # would keep them alive after destroy_process_group() until the interpreter exits,
        # where gloo's late teardown can abort a process whose run succeeded
        groups, cp, _ = resolve_groups(group, comm)
        check_member(cp)        # a rank outside the group: the library's error, now
        held = weak(groups)
    _CONFIG.update(group=held, comm=comm, backend=backend)


def _configured_group():
    """The group set by use_cp_group as cp_attention takes it (a pair for a2a+p2p), or None."""
    held = _CONFIG["group"]
    if held is None:
        return None
    groups = tuple(r() for r in held)
    if None in groups:
        raise RuntimeError("the CP process group set by cp_softcap.integrations.hf.use_cp_group "
                           "no longer exists (torch.distributed.destroy_process_group ran); call "
                           "use_cp_group again with a live group, or use_cp_group(None) for one device")
    return groups if len(groups) == 2 else groups[0]


def _cp_size_rank(group, comm: str) -> Tuple[int, int]:
    """(cp size, CP rank) of `group` for `comm`; a2a+p2p: ring rank * a2a size + a2a rank."""
    if group is None:
        return 1, 0
    _, cp, rank = resolve_groups(group, comm)
    return cp, rank


def _check_mask(mask) -> None:
    if mask_is_empty(mask):
        return
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        raise padding_mask_error(mask.shape)
    shape = tuple(getattr(mask, "shape", ()))
    raise ValueError(
        f"attn_implementation='cp_softcap' got a dense attention mask of type {type(mask).__name__} "
        f"shape {shape}; it applies causal and sliding-window masks itself (from global positions) and "
        "cannot apply an arbitrary mask. Call the model without attention_mask (or with an all-ones "
        "2-D mask), or use attn_implementation='eager' for custom masks.")


def hf_window(sliding_window: int, causal: bool = True):
    """HF's `sliding_window` w as cp_softcap's window: key j is visible from query i iff
    i - w < j <= i (causal; non-causal layers see w - 1 keys on each side)."""
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _boundaries(b: int, sq: int, sk: int, position_ids, kwargs, traced: bool = False):
    """One device: (boundaries, joined) where joined says they cover the b rows joined into one
    stream of b * sq tokens (else every row has them); (None, False) for an unpacked batch. See
    the module docstring for where they come from. traced (under torch.compile): the resets of
    position_ids are not read here but inside the library's operator."""
    cu, joined = kwargs.get("cu_seqlens"), False
    if cu is None and kwargs.get("cu_seq_lens_q") is not None:
        joined = True
        cu, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k")
        if cu_k is not None and not traced:     # traced: compared inside the operator
            if not torch.equal(torch.as_tensor(cu).cpu(), torch.as_tensor(cu_k).cpu()):
                raise different_boundaries_error()
    if cu is not None:
        if sq != sk:
            raise ValueError(f"packed documents (cu_seqlens) with query length {sq} != key length "
                             f"{sk}: generation with a KV cache takes unpacked sequences")
        return cu, joined
    if position_ids is None or sq != sk or sq < 2:
        return None, False
    if position_ids.shape[-1] != sq:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not match the query length {sq}")
    if traced:
        return None, False
    found = boundaries_from_positions(position_ids, b)
    return found, found is not None


def _mask_function(*args, attention_mask=None, use_vmap: bool = False, **kwargs):
    """transformers mask hook for "cp_softcap": builds nothing. It returns None for no mask or
    an all-ones one and refuses any other; under torch.compile it returns a 2-D mask as it is,
    for the attention function to hand to the library's operator, which reads it there."""
    if use_vmap:
        raise ValueError("this model changes the causal mask with extra mask functions (e.g. bidirectional "
                         "image tokens); attn_implementation='cp_softcap' applies only causal and "
                         "sliding-window masks. Use attn_implementation='eager' for this model.")
    if compiling() and _is_2d(attention_mask):
        return attention_mask          # read inside the operator (_traced), not in the graph
    _check_mask(attention_mask)
    return None


def _is_2d(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 2


# keywords read below (packed documents, causality), and the ones that do not change attention
_IMPLEMENTED = frozenset({"cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "is_causal"})
_HARMLESS = frozenset({
    "max_length_q", "max_length_k",     # lengths of the documents cu_seq_lens_q/_k give
    "seq_idx",                          # the same documents, per token (for Mamba layers)
    "num_items_in_batch", "shift_labels", "labels",     # the loss's, passed through every layer
    "output_attentions", "output_hidden_states", "output_router_logits", "use_cache",
    "cache_position", "return_dict"})


def _check_kwargs(kwargs: dict) -> None:
    """Refuse keywords this function does not implement (a value of None means "not given")."""
    for name, value in kwargs.items():
        if value is None or name in _IMPLEMENTED or name in _HARMLESS:
            continue
        raise ValueError(
            f"attn_implementation='cp_softcap' got the keyword argument {name!r} "
            f"({type(value).__name__}), which it does not implement and which may change the "
            f"attention result; it implements scaling, softcap, sliding_window, is_causal, s_aux "
            f"(attention sinks), dropout=0.0 and packed documents (cu_seqlens / cu_seq_lens_q, "
            f"position_ids). Use attn_implementation='eager' for this model, or file an issue "
            f"naming {name!r}.")


def cp_softcap_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask=None, scaling: Optional[float] = None,
                         dropout: float = 0.0, softcap: Optional[float] = None,
                         sliding_window: Optional[int] = None, position_ids=None, cp_group=None,
                         s_aux: Optional[torch.Tensor] = None,
                         **kwargs) -> Tuple[torch.Tensor, None]:
    """HF attention function. query [B, Hq, S, D], key/value [B, Hkv, Sk, D] (local shards under
    CP) -> (out [B, S, Hq, D], None). sliding_window w: key j visible from query i iff
    i - w < j <= i, i.e. window (w - 1, 0).

    Packed documents: on one device from kwargs cu_seqlens / cu_seq_lens_q,k or position_ids
    resets (the rows joined into one stream); under CP only from the GLOBAL `cu_seqlens` kwarg
    (model(..., cu_seqlens=cu_global)), passed on to cp_attention(..., cu_seqlens=cu_global):
    a rank's position_ids show only its shard's resets, never the global boundaries.

    s_aux: gpt-oss's learned attention sinks [Hq] (the module's `sinks` parameter), passed on
    as sinks= (its gradient on each CP rank: the sum over that rank's rows; the usual gradient
    all-reduce across ranks sums it). Any keyword not implemented is refused (module docstring)."""
    _check_kwargs(kwargs)
    if dropout:
        raise ValueError(f"attn_implementation='cp_softcap' got attention dropout={dropout}; it is "
                         "exact and has no dropout. Set config.attention_dropout = 0.0.")
    traced_mask = attention_mask if compiling() and _is_2d(attention_mask) else None
    if traced_mask is None:
        _check_mask(attention_mask)
    group = cp_group if cp_group is not None else _configured_group()
    comm = _CONFIG["comm"] if group is not None else "ring"     # one device: comm is moot
    cp, rank = _cp_size_rank(group, comm)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    sq, sk = q.shape[1], k.shape[1]
    if cp > 1 and sq != sk:
        raise ValueError(f"query length {sq} != key length {sk} under cp={cp}: generation with a KV "
                         "cache is not context parallel; call use_cp_group(None) for generation.")
    if not (q.dtype == k.dtype == v.dtype):    # e.g. fp32 RoPE output with bf16 v under autocast
        dt = (torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type)
              else v.dtype)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    options = dict(softcap=softcap, causal=causal, scale=q.shape[-1] ** -0.5 if scaling is None else scaling,
                   window=hf_window(sliding_window, causal) if sliding_window else None,
                   backend=_CONFIG["backend"], sinks=s_aux)
    if cp > 1 and kwargs.get("cu_seqlens") is None and kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("attn_implementation='cp_softcap' under CP got cu_seq_lens_q (boundaries "
                         "of this rank's tokens); packed documents under CP need the GLOBAL "
                         "boundaries: model(..., cu_seqlens=cu_global), identical on every rank")
    if compiling():
        return _traced(q, k, v, group, comm, cp, position_ids, traced_mask, kwargs, options), None
    if cp == 1:                        # no CP group, or one of one rank (DP-only runs too)
        cu, joined = _boundaries(q.shape[0], sq, sk, position_ids, kwargs)
        if cu is not None:
            b = q.shape[0]
            if joined:
                q, k, v = _join_rows(q, k, v)
            out = attention(q, k, v, cu_seqlens=cu, **options)
            return out.reshape(b, sq, *out.shape[2:]), None
        # generation with a KV cache: the new queries are the LAST positions of the keys
        # (HF's cache_position), which is bottom-right alignment
        return attention(q, k, v, causal_align="bottom_right", **options), None
    cu = kwargs.get("cu_seqlens")
    if cu is not None:
        # read once (a device sync for a CUDA tensor): the position check and the call share it
        values = boundary_values(cu)
        cu = cu if values is None else values
    if position_ids is not None:
        check_positions(position_ids, sq, cp, rank, cu_seqlens=cu)
    out = cp_attention(q, k, v, group, comm=comm, cu_seqlens=cu, **options)
    return out, None


def _join_rows(*tensors):
    """[B, S, ...] -> [1, B * S, ...]: the batch rows joined into one packed stream."""
    return tuple(t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:]) for t in tensors)


def _traced(q, k, v, group, comm, cp, position_ids, mask, kwargs, options):
    """The call while torch.compile traces the model: the library's operator (cp_softcap.compiled)
    with position_ids and a 2-D attention mask, which it reads inside, eagerly (packed rows from
    the resets on one device, the layout check under CP; the mask must be all ones), so no layer
    breaks the graph to read them."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    options = dict(options)
    sinks = options.pop("sinks")
    if cp == 1:
        cu, joined = _boundaries(b, sq, sk, position_ids, kwargs, traced=True)
        if joined:
            q, k, v = _join_rows(q, k, v)
        pos = position_ids if cu is None and sq == sk and sq >= 2 else None
        cu_k = kwargs.get("cu_seq_lens_k") if joined else None
        out, _ = compiled_attention(q, k, v, group_names_="", comm="ring", cu_seqlens=cu,
                                    one_device=True, sinks=sinks, positions=pos, mask=mask,
                                    cu_seqlens_k=None if cu_k is None else torch.as_tensor(cu_k),
                                    **options)
        return out.reshape(b, sq, *out.shape[2:])
    out, _ = compiled_attention(q, k, v, group_names_=group_names(group, comm), comm=comm,
                                cu_seqlens=kwargs.get("cu_seqlens"), one_device=False, sinks=sinks,
                                positions=position_ids, mask=mask, **options)
    return out


def register(name: str = NAME) -> None:
    """Register cp_softcap_attention with transformers under `name` (done on import)."""
    from transformers import AttentionInterface
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        import transformers
        raise ImportError(f"cp_softcap.integrations.hf needs transformers >= 4.53 (for "
                          f"masking_utils.AttentionMaskInterface); found {transformers.__version__}. "
                          "pip install -U 'transformers>=4.53'") from e
    AttentionInterface.register(name, cp_softcap_attention)
    AttentionMaskInterface.register(name, _mask_function)


register()
