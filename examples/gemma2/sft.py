"""Supervised fine-tuning of Gemma2 with TRL's SFTTrainer and context parallelism (CPU, gloo).

    torchrun --nproc-per-node 4 examples/gemma2/sft.py                       # dp 2 x cp 2, ring, packed
    torchrun --nproc-per-node 4 examples/gemma2/sft.py --cp 4 --comm a2a --no-packing
    torchrun --nproc-per-node 4 examples/gemma2/sft.py --model-dir PATH      # a local Gemma2 checkpoint
    python examples/gemma2/sft.py --cp 1                                     # one process, no CP

The data is a chat-format toy dataset built here (arithmetic questions and answers, no
download), trained on the assistant turns only (SFTConfig(assistant_only_loss=True)). Without
--model-dir the model is a tiny random Gemma2 (attention and final softcaps, a 16-token window
shorter than the conversations) with a character-level tokenizer built here; with --model-dir it
is loaded from that directory (config, weights and tokenizer with a chat template), in float32.
SFTConfig(packing=True) packs the conversations padding-free (TRL's BFD packing); --no-packing
keeps one conversation per row, flattened padding-free (padding_free=True). Needs
pip install -e ".[sft]" (without it, it says so in one line).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":       # before the imports that need them: one line naming the extra
    from extras import require   # examples/gemma2/extras.py
    require("sft.py")

import torch  # noqa: E402

from hf_trainer import HEADS, RankZeroParser, tiny_gemma2  # noqa: E402  (examples/gemma2/hf_trainer.py)

SPECIALS = ["<pad>", "<eos>", "<bos>", "<user>", "<assistant>", "<end>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
# each message ends with <end>; the assistant's content and its <end> are the generated part
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant>"
    "{% generation %}{{ m['content'] }}<end>{% endgeneration %}{% else %}<user>{{ m['content'] }}<end>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def toy_tokenizer():
    """A character-level fast tokenizer with the chat template above (ids < 259, the tiny
    model's vocabulary)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<end>",
                                        bos_token="<bos>", additional_special_tokens=SPECIALS[3:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def chat_rows(n: int, seed: int = 0, *, prompt_completion: bool = False) -> list:
    """n toy conversations of 30-70 tokens: {"messages": [user, assistant]}, or the same as
    {"prompt": [user], "completion": [assistant]} (TRL's conversational prompt-completion)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in torch.randint(0, 10 ** int(torch.randint(1, 5, (), generator=g)), (2,),
                                              generator=g))
        op = ["plus", "times", "minus"][int(torch.randint(0, 3, (), generator=g))]
        value = {"plus": a + b, "times": a * b, "minus": a - b}[op]
        user = {"role": "user", "content": f"What is {a} {op} {b}?"}
        assistant = {"role": "assistant", "content": f"{a} {op} {b} is {value}."}
        rows.append({"prompt": [user], "completion": [assistant]} if prompt_completion
                    else {"messages": [user, assistant]})
    return rows


def sft_config(output_dir: str, **overrides):
    """SFTConfig for a few CPU steps; overrides replace any of them."""
    from trl import SFTConfig
    kw = dict(output_dir=output_dir, use_cpu=True, per_device_train_batch_size=4,
              per_device_eval_batch_size=4, gradient_accumulation_steps=2, max_steps=4, learning_rate=3e-3,
              lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
              disable_tqdm=True, ddp_find_unused_parameters=False, seed=0, packing=True,
              assistant_only_loss=True)
    kw.update(overrides)
    # packing fills rows of max_length tokens; padding-free rows without packing are not truncated
    kw.setdefault("max_length", 128 if kw["packing"] else None)
    return SFTConfig(**kw)


def parse(argv=None) -> argparse.Namespace:
    """The flags, checked against torchrun's WORLD_SIZE before any process group exists."""
    p = RankZeroParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=2, help="CP size, dividing the ranks; dp = ranks / cp (default 2)")
    p.add_argument("--comm", default="ring", choices=("ring", "all_gather", "a2a", "auto"),
                   help="CP algorithm (default ring); a2a needs cp to divide the model's query heads")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    p.add_argument("--no-packing", action="store_true",
                   help="one conversation per row, padding-free (default: TRL's BFD packing)")
    p.add_argument("--model-dir", help="a local Gemma2 checkpoint directory (config, safetensors, tokenizer "
                   "with a chat template); default: a tiny random Gemma2 and a toy tokenizer")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    problems = [f"--{name} must be >= 1, got {getattr(a, name)}" for name in ("cp", "steps")
                if getattr(a, name) < 1]
    if a.cp >= 1 and world % a.cp:
        problems.append(f"--cp {a.cp} must divide the {world} ranks (dp = ranks / cp); use one of "
                        f"{', '.join(str(c) for c in range(1, world + 1) if world % c == 0)}")
    elif a.cp >= 1 and a.comm == "a2a" and not a.model_dir and HEADS % a.cp:
        problems.append(f"--comm a2a splits the {HEADS} query heads over cp={a.cp} ranks; use a --cp "
                        "that divides 4, or --comm ring / all_gather / auto")
    if a.model_dir and not os.path.isfile(os.path.join(a.model_dir, "config.json")):
        problems.append(f"--model-dir {a.model_dir} has no config.json")
    if problems:
        p.error("\n  " + "\n  ".join(problems) if len(problems) > 1 else problems[0])
    return a


def load(model_dir):
    """(model, tokenizer): the local checkpoint, or the tiny random Gemma2 and the toy tokenizer."""
    if model_dir is None:
        return tiny_gemma2(softcap=3.0, final_softcap=5.0, window=16), toy_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="cp_softcap",
                                                 dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_dir)


def main(argv=None) -> None:
    a = parse(argv)
    from datasets import Dataset

    from cp_softcap.integrations.trl_sft import CPSFTTrainer, cp_mesh
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        packing = not a.no_packing
# [README:cpsfttrainer begin]
        args = sft_config(tmp, max_steps=a.steps, packing=packing, padding_free=True)
        mesh = cp_mesh(a.cp)
        model, tokenizer = load(a.model_dir)
        trainer = CPSFTTrainer(model=model, args=args, processing_class=tokenizer, cp_mesh=mesh,
                               cp_comm=a.comm, train_dataset=Dataset.from_list(chat_rows(96)),
                               eval_dataset=Dataset.from_list(chat_rows(8, seed=1)))
        trainer.train()
# [README:cpsfttrainer end]
        metrics = trainer.evaluate()
    if args.process_index == 0:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        print(f"dp {mesh.size(0)} x cp {mesh.size(1)} ({a.comm}, {'packed' if packing else 'padding-free'}): "
              f"train losses {[round(h['loss'], 4) for h in logs]}, token accuracy "
              f"{logs[-1]['mean_token_accuracy']:.4f}, tokens {logs[-1]['num_tokens']:.0f}, "
              f"eval loss {metrics['eval_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
