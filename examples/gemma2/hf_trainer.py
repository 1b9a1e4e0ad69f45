"""Fine-tune a tiny random Gemma2 with HF `Trainer` and context parallelism (CPU, gloo).

    torchrun --nproc-per-node 4 examples/gemma2/hf_trainer.py              # dp 2 x cp 2, ring
    torchrun --nproc-per-node 4 examples/gemma2/hf_trainer.py --cp 4 --comm a2a --unpacked
    python examples/gemma2/hf_trainer.py --cp 1                            # one process, no CP

The model keeps Gemma2's structure (attention softcap, final-logit softcap, a sliding window of
16 tokens on even layers, shorter than the 32-64-token documents, GQA 4/2) at a toy size; the data
are documents of the standard library's pydoc text under a byte-level tokenizer, packed by
transformers' DataCollatorWithFlattening (each batch one row, documents attend only to
themselves), or with --unpacked one per row, right-padded with labels -100 (no attention mask:
causal attention never looks at the pads). CPTrainer (cp_softcap.integrations.hf_trainer) gives
every CP rank of a dp group the same batch and keeps its shard; the logged loss is the loss of
the whole global batch, as on one process. Needs transformers >= 5 and accelerate
(pip install -e ".[sft]"; without them it says so in one line), no download.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from extras import RankZeroParser, require  # noqa: E402  (examples/gemma2/extras.py: standard library only)

if __name__ == "__main__":       # before the imports that need them: one line naming the extra
    require("hf_trainer.py", ("transformers", "accelerate"))

import torch  # noqa: E402
import transformers  # noqa: E402

from cp_softcap.integrations.hf_trainer import CPTrainer, cp_mesh  # noqa: E402
from cp_softcap.sharding import fits_zigzag  # noqa: E402

PAD, VOCAB = 0, 259                       # byte-level ids: byte + 3; pad 0, eos 1, bos 2


def tiny_gemma2(attn_implementation: str = "cp_softcap", *, softcap: float = 50.0,
                final_softcap: float = 30.0, window: int = 16, seed: int = 0):
    """A random 2-layer Gemma2 (a real one: Gemma2ForCausalLM.from_pretrained(path,
    attn_implementation="cp_softcap")); the same weights for the same seed on every rank."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=window, attn_logit_softcapping=softcap, final_logit_softcapping=final_softcap,
        attention_dropout=0.0, pad_token_id=PAD, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return transformers.Gemma2ForCausalLM(config)


def text_rows(n: int, seq_len: int, seed: int = 0, *, packed: bool = False) -> list:
    """n documents of seq_len/2..seq_len tokens (bos + bytes of the pydoc text): for packing,
    {"input_ids": doc} (DataCollatorWithFlattening packs a batch into one row and masks each
    document's first label); else rows {"input_ids", "labels"} right-padded to seq_len with
    labels -100."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(seq_len // 2, seq_len + 1, (), generator=g))
        start = int(torch.randint(0, len(text) - seq_len, (), generator=g))
        doc = [2] + [b + 3 for b in text[start:start + length - 1]]
        pad = seq_len - length
        rows.append({"input_ids": doc} if packed else
                    {"input_ids": doc + [PAD] * pad, "labels": doc + [-100] * pad})
    return rows


def training_args(output_dir: str, **overrides) -> transformers.TrainingArguments:
    """Trainer settings for a few CPU steps; overrides replace any of them."""
    kw = dict(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=2,
              per_device_eval_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
              learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
              report_to=[], disable_tqdm=True, ddp_find_unused_parameters=False, seed=0,
              dataloader_drop_last=True)
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


HEADS = 4                                 # tiny_gemma2's query heads


def parse(argv=None) -> argparse.Namespace:
    """The flags, checked against torchrun's WORLD_SIZE before any process group exists."""
    p = RankZeroParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=2, help="CP size, dividing the ranks; dp = ranks / cp (default 2)")
    p.add_argument("--comm", default="ring", choices=("ring", "all_gather", "a2a", "auto"),
                   help="CP algorithm (default ring); a2a needs cp to divide the 4 query heads. Not "
                   "a2a+p2p: it needs a hybrid group from cp_softcap.make_hybrid_groups, and CPTrainer "
                   "takes the mesh's flat cp group")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    p.add_argument("--seq-len", type=int, default=64, help="longest document (default 64)")
    p.add_argument("--unpacked", action="store_true",
                   help="one document per row, padded to --seq-len (a multiple of 2 * cp)")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    problems = [f"--{name} must be >= {low}, got {getattr(a, name.replace('-', '_'))}"
                for name, low in (("cp", 1), ("steps", 1), ("seq-len", 2))
                if getattr(a, name.replace("-", "_")) < low]
    if a.cp >= 1 and world % a.cp:
        problems.append(f"--cp {a.cp} must divide the {world} ranks (dp = ranks / cp); use one of "
                        f"{', '.join(str(c) for c in range(1, world + 1) if world % c == 0)}")
    elif a.cp >= 1 and a.comm == "a2a" and HEADS % a.cp:
        problems.append(f"--comm a2a splits the {HEADS} query heads over cp={a.cp} ranks; use a --cp "
                        "that divides 4, or --comm ring / all_gather / auto")
    if a.cp >= 1 and a.unpacked and not fits_zigzag(a.seq_len, a.cp):
        problems.append(f"--unpacked rows of --seq-len {a.seq_len} must be a multiple of 2 * cp = "
                        f"{2 * a.cp}")
    if problems:
        p.error("\n  " + "\n  ".join(problems) if len(problems) > 1 else problems[0])
    return a


def main(argv=None) -> None:
    a = parse(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
# [README:cptrainer begin]
        args = training_args(tmp, max_steps=a.steps)          # initialises torch.distributed
        mesh = cp_mesh(a.cp)
        packed = not a.unpacked
        collator = transformers.DataCollatorWithFlattening() if packed else None
        trainer = CPTrainer(model=tiny_gemma2(), args=args, cp_mesh=mesh, cp_comm=a.comm,
                            data_collator=collator, train_dataset=text_rows(64, a.seq_len, packed=packed),
                            eval_dataset=text_rows(8, a.seq_len, seed=1, packed=packed))
        trainer.train()
# [README:cptrainer end]
        metrics = trainer.evaluate()
    if args.process_index == 0:
        losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
        layout = "unpacked" if a.unpacked else "packed"
        print(f"dp {mesh.size(0)} x cp {mesh.size(1)} ({a.comm}, {layout}): train losses {losses}, "
              f"eval loss {metrics['eval_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
