"""Supervised fine-tuning of an HF causal LM of any tested family (Gemma2, Gemma3, Mistral, Qwen2,
gpt-oss, Llama) with TRL's SFTTrainer and context parallelism (CPU, gloo).

    torchrun --nproc-per-node 4 examples/hf/sft.py --family gpt_oss            # dp 2 x cp 2, ring
    torchrun --nproc-per-node 4 examples/hf/sft.py --family gemma3 --cp 4 --comm a2a
    torchrun --nproc-per-node 4 examples/hf/sft.py --model-dir PATH             # a local checkpoint
    python examples/hf/sft.py --family qwen2 --cp 1                              # one process, no CP

Without --model-dir the model is the family's tiny random config (examples/hf/families.py: its
sliding windows, softcaps, learned attention sinks or MoE at a toy size, every window shorter
than the conversations) with a character-level tokenizer, no download. With --model-dir it is
loaded from that directory (config, safetensors weights, a tokenizer with a chat template) with
attn_implementation="cp_softcap", in float32; its family is the checkpoint's own. The data is a
toy prompt-completion chat dataset (arithmetic questions and answers, examples/gemma2/sft.py),
trained on the completions only. cp_softcap's CPSFTTrainer gives every CP rank of a dp group
the same batch and keeps its shard; the logged loss is the loss of the whole global batch, as
on one process. SFTConfig(packing=True) packs the conversations padding-free (TRL's BFD
packing); --no-packing keeps one conversation per row, flattened padding-free
(padding_free=True). Needs pip install -e ".[sft]" (without it, it says so in one line).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))       # examples/, for the gemma2 example's toy data
from gemma2.extras import RankZeroParser, require  # noqa: E402  (standard library only)

if __name__ == "__main__":       # before the imports that need them: one line naming the extra
    require("sft.py")

import torch  # noqa: E402

from families import FAMILIES, tiny_model  # noqa: E402  (examples/hf/families.py)

COMMS = ("ring", "all_gather", "a2a", "auto")


def parse(argv=None) -> argparse.Namespace:
    """The flags, checked against torchrun's WORLD_SIZE before any process group exists."""
    p = RankZeroParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=FAMILIES, default="gemma2",
                   help="the tiny random model to fine-tune (default gemma2); ignored with --model-dir")
    p.add_argument("--model-dir", help="a local checkpoint directory (config, safetensors, tokenizer with "
                   "a chat template) of a model whose attention runs under attn_implementation='cp_softcap'")
    p.add_argument("--cp", type=int, default=2, help="CP size, dividing the ranks; dp = ranks / cp (default 2)")
    p.add_argument("--comm", default="ring", choices=COMMS,
                   help="CP algorithm (default ring); a2a needs cp to divide the model's query heads")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    p.add_argument("--no-packing", action="store_true",
                   help="one conversation per row, padding-free (default: TRL's BFD packing)")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    problems = [f"--{name} must be >= 1, got {getattr(a, name)}" for name in ("cp", "steps")
                if getattr(a, name) < 1]
    heads = 4                                   # every tiny config's query heads
    if a.model_dir:
        path = os.path.join(a.model_dir, "config.json")
        if not os.path.isfile(path):
            problems.append(f"--model-dir {a.model_dir} has no config.json")
        else:
            with open(path) as f:
                config = json.load(f)
            config = config.get("text_config", config)
            heads = config.get("num_attention_heads", heads)
    if a.cp >= 1 and world % a.cp:
        problems.append(f"--cp {a.cp} must divide the {world} ranks (dp = ranks / cp); use one of "
                        f"{', '.join(str(c) for c in range(1, world + 1) if world % c == 0)}")
    elif a.cp >= 1 and a.comm == "a2a" and heads % a.cp:
        problems.append(f"--comm a2a splits the {heads} query heads over cp={a.cp} ranks; use a --cp "
                        f"that divides {heads}, or --comm ring / all_gather / auto")
    if problems:
        p.error("\n  " + "\n  ".join(problems) if len(problems) > 1 else problems[0])
    return a


def load(family: str, model_dir=None):
    """(model, tokenizer): the local checkpoint, or the family's tiny random model and the toy
    character-level tokenizer."""
    if model_dir is None:
        from gemma2.sft import toy_tokenizer
        return tiny_model(family), toy_tokenizer()
    import cp_softcap.integrations.hf  # noqa: F401  (registers attn_implementation="cp_softcap")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="cp_softcap",
                                                 dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_dir)


def sft_args(output_dir: str, **overrides):
    """SFTConfig for a few CPU steps on the prompt-completion data (completion-only loss). No MoE
    load-balancing loss (gpt-oss): it is a function of the routing of the whole batch, which no
    CP rank sees, and CPSFTTrainer refuses it."""
    from gemma2.sft import sft_config
    return sft_config(output_dir, **{"assistant_only_loss": False, "router_aux_loss_coef": 0.0,
                                     **overrides})


def datasets():
    """(train, eval): 96 and 8 toy prompt-completion conversations."""
    from datasets import Dataset

    from gemma2.sft import chat_rows
    return (Dataset.from_list(chat_rows(96, prompt_completion=True)),
            Dataset.from_list(chat_rows(8, seed=1, prompt_completion=True)))


def main(argv=None) -> dict:
    """Fine-tune; returns rank 0's summary (the others: {})."""
    a = parse(argv)
    from cp_softcap.integrations.trl_sft import CPSFTTrainer, cp_mesh
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        packing = not a.no_packing
        args = sft_args(tmp, max_steps=a.steps, packing=packing, padding_free=True)
        mesh = cp_mesh(a.cp)
        model, tokenizer = load(a.family, a.model_dir)
        train, evaluation = datasets()
        trainer = CPSFTTrainer(model=model, args=args, processing_class=tokenizer, cp_mesh=mesh,
                               cp_comm=a.comm, train_dataset=train, eval_dataset=evaluation)
        trainer.train()
        metrics = trainer.evaluate()
    if args.process_index != 0:
        return {}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    summary = {"family": model.config.model_type, "dp": mesh.size(0), "cp": mesh.size(1), "comm": a.comm,
               "losses": [h["loss"] for h in logs], "eval_loss": metrics["eval_loss"],
               "token_accuracy": logs[-1]["mean_token_accuracy"]}
    print(f"{summary['family']}: dp {mesh.size(0)} x cp {mesh.size(1)} ({a.comm}, "
          f"{'packed' if packing else 'padding-free'}): train losses "
          f"{[round(x, 4) for x in summary['losses']]}, token accuracy {summary['token_accuracy']:.4f}, "
          f"eval loss {metrics['eval_loss']:.4f}", flush=True)
    return summary


if __name__ == "__main__":
    main()
