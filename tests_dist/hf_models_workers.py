"""One launch for tests_dist/test_hf_models_cp.py: every tested HF family under
attn_implementation="cp_softcap" at cp 4, every comm, against HF's "eager" attention on one
process; CPTrainer and CPSFTTrainer fine-tuning gpt-oss against the plain one-process trainers,
and CPTrainer's refusal of a MoE load-balancing loss; examples/hf/sft.py on 2 ranks against its
own one-process run.

    python tests_dist/hf_models_workers.py OUT_DIR        # writes OUT_DIR/results.json

This process imports torch, transformers, TRL and cp_softcap once and forks every other process
from itself (4 gloo ranks, then 2; and one reference process beside them), so the imports that
dominate a tiny model's test are paid once, not once per rank. Each part's failure is recorded
in the results (a traceback, per model case where a case fails alone) instead of ending the run,
so the tests report every case.

Models: examples/hf/families.py's tiny configs in float64 (gpt-oss with its "eager" experts,
as its default grouped matmul refuses float64), weights scaled up so that Gemma2's softcaps
(3 and 5 here) saturate, gpt-oss's sinks 8, -1, 10, 0.5 (they dominate the rows of heads 0 and
2). Rows of S = 48 tokens, longer than every window; packed: one row of documents of 1, 7, 17
and 23 tokens (two longer than every window) with the GLOBAL boundaries passed as
model(..., cu_seqlens=cu), against each document run alone through eager. Compared: the logits
put back together, the loss summed over the ranks (each rank's cross-entropy sum / the global
label count), and every parameter's gradient summed over the ranks (what DDP / FSDP do).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)   # benchmarks.ranks
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "examples", "hf"))

WORLD, S, B = 4, 48, 2
DOCS = (1, 7, 17, 23)
COMMS = ("ring", "all_gather", "a2a", "a2a+p2p", "auto")
LAYOUTS = ("rows", "packed")
# the trainers: gradient accumulation 2, 3 optimizer steps, 2 rows per dp rank and micro-step
STEPS, GA, PER_DEVICE = 3, 2, 2


def rel(a, b) -> float:
    """max |a - b| / max |b| in float64; inf when either holds a NaN or inf (never a pass)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- models x comms x layouts

def _data():
    """(ids [B, S], shifted labels [B, S]; packed ids [1, S], its shifted labels, boundaries):
    the labels are shifted on the full sequence (each document's last token has none)."""
    g = torch.Generator().manual_seed(1)
    from families import VOCAB
    ids = torch.randint(3, VOCAB, (B, S), generator=g)
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    shift[0, 5:9] = -100                               # a masked span, as a prompt's would be
    packed = torch.randint(3, VOCAB, (1, S), generator=g)
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    packed_shift = torch.full_like(packed, -100)
    for a, b in zip(cu, cu[1:]):
        packed_shift[:, a:b - 1] = packed[:, a + 1:b]
    return ids, shift, packed, packed_shift, cu


def _reference(model, ids, shift, cu=None, *, each_document: bool = True) -> dict:
    """`model` on one process: logits, loss (cross-entropy sum / the label count) and every
    parameter's gradient. Packed documents (cu) run each alone, or with each_document=False
    the whole row with model(..., cu_seqlens=cu) (cp_softcap on one device)."""
    n = int((shift != -100).sum())
    model.zero_grad(set_to_none=True)
    spans, kw = [(0, ids.shape[1])], {}
    if cu is not None and each_document:
        spans = list(zip(cu, cu[1:]))
    elif cu is not None:          # each document's positions from 0, as the CP shards have them
        kw = {"cu_seqlens": cu,
              "position_ids": torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]}
    logits, loss = [], 0.0
    for a, b in spans:
        out = model(input_ids=ids[:, a:b], labels=shift[:, a:b], shift_labels=shift[:, a:b],
                    num_items_in_batch=n, **kw)
        out.loss.backward()
        logits.append(out.logits.detach())
        loss += out.loss.item()
    return {"logits": torch.cat(logits, 1), "loss": loss, "n": n,
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}


def _library_calls(model, ids) -> list:
    """What each attention layer hands the library on one device: (window, softcap, sinks)."""
    from cp_softcap.integrations import hf as hf_int
    seen, original = [], hf_int.attention

    def recording(*args, **kw):
        seen.append([kw.get("window"), kw.get("softcap"), kw.get("sinks") is not None])
        return original(*args, **kw)
    hf_int.use_cp_group(None)
    hf_int.attention = recording
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        hf_int.attention = original
    return [[list(w) if w is not None else None, c, s] for w, c, s in seen]


def _controls(family, eager, ids) -> dict:
    """How far the eager logits move without the window (every window wider than the rows),
    and for gpt-oss without the sinks: a comparison that passes below these would have caught
    a dropped window or sink."""
    import copy

    from hf_models import family_pair
    ref = eager(input_ids=ids).logits.detach()
    out = {}
    if getattr(eager.config, "sliding_window", None):
        wide, _ = family_pair(family, sliding_window=4 * S)
        wide.load_state_dict(eager.state_dict())
        out["window dropped"] = rel(wide(input_ids=ids).logits.detach(), ref)
    if family == "gpt_oss":
        nosink = copy.deepcopy(eager)
        with torch.no_grad():
            for name, p in nosink.named_parameters():
                if name.endswith("sinks"):
                    p.fill_(-1e4)             # exp(-1e4) == 0: no sink in any row
        out["sinks dropped"] = rel(nosink(input_ids=ids).logits.detach(), ref)
    return out


def _errors(logits, loss, model, ref) -> dict:
    grads = {k: rel(p.grad, ref["grads"][k]) for k, p in model.named_parameters()}
    worst = max(grads, key=grads.get)
    return {"logits": rel(logits, ref["logits"]), "loss": rel(loss, ref["loss"]),
            "grads": grads[worst], "worst": worst}


def _cp_case(ours, refs, ids, shift, cu, group, comm, rank) -> dict:
    """One CP forward + backward; its errors against eager (refs[0]) and against cp_softcap on
    one device (refs[1]: the same attention math, so only the CP split can differ)."""
    import cp_softcap as cps
    from cp_softcap.integrations import hf as hf_int
    ours.zero_grad(set_to_none=True)
    hf_int.use_cp_group(group, comm=comm)
    kw = {} if cu is None else {"cu_seqlens": cu}
    lab = cps.sharding.shard(shift, WORLD, rank, pad_value=-100, **kw).contiguous()
    out = ours(input_ids=cps.sharding.shard(ids, WORLD, rank, **kw).contiguous(),
               position_ids=cps.sharding.positions(S, WORLD, rank, **kw)[None],
               labels=lab, shift_labels=lab, num_items_in_batch=refs[0]["n"], **kw)
    out.loss.backward()
    # the loss and every gradient summed over the ranks, in one all-reduce
    params = list(ours.parameters())
    flat = torch.cat([out.loss.detach().reshape(1)] + [p.grad.flatten() for p in params])
    dist.all_reduce(flat)
    loss, grads = flat[0], flat[1:].split([p.numel() for p in params])
    for p, g in zip(params, grads):
        p.grad.copy_(g.view_as(p.grad))
    logits = cps.sharding.gather(out.logits.detach().contiguous(), **kw)[:, :S]
    hf_int.use_cp_group(None)
    return {"eager": _errors(logits, loss, ours, refs[0]), "one device": _errors(logits, loss, ours, refs[1])}


def model_cases(rank: int, world: int, families) -> dict:
    """Every family x comm x layout at cp = world; rank 0's view (the values are global)."""
    import logging

    import cp_softcap as cps
    from cp_softcap.integrations import hf as hf_int
    from hf_models import family_pair
    logging.getLogger("transformers").setLevel(logging.ERROR)
    groups = {c: dist.group.WORLD for c in COMMS}
    groups["a2a+p2p"] = cps.make_hybrid_groups(None, 2)      # a2a groups of 2, rings across them
    ids, shift, packed, packed_shift, cu = _data()
    cases, checks = {}, {}
    for family in families:
        torch.manual_seed(0)
        eager, ours = family_pair(family)
        hf_int.use_cp_group(None)
        checks[family] = {"calls": _library_calls(ours, ids), **_controls(family, eager, ids)}
        for layout in LAYOUTS:
            inputs = (ids, shift, None) if layout == "rows" else (packed, packed_shift, cu)
            refs = (_reference(eager, *inputs), _reference(ours, *inputs, each_document=False))
            checks[family][f"one device {layout}"] = _errors(refs[1]["logits"], refs[1]["loss"], ours, refs[0])
            for comm in COMMS:
                key = f"{family} {comm} {layout}"
                t = time.process_time()
                try:
                    cases[key] = _cp_case(ours, refs, *inputs, groups[comm], comm, rank)
                except Exception:       # the same on every rank: the next case still runs
                    cases[key] = {"error": traceback.format_exc()[-3000:]}
                cases[key]["cpu_s"] = time.process_time() - t
        hf_int.use_cp_group(None)
    return {"cases": cases, "checks": checks}


# ---------------------------------------------------------------- trainers (gpt-oss)

def trainer_model():
    """The tiny gpt-oss with saturating weights and dominant sinks, float64, eager experts."""
    from hf_models import family_pair
    torch.manual_seed(0)
    eager, ours = family_pair("gpt_oss")
    return eager, ours


def text_rows(n: int, seed: int, padded: bool = False) -> list:
    """n documents of 12-40 random tokens (longer than the 6-token window): unpadded, for
    DataCollatorWithFlattening; or padded=True, right-padded to 40 with labels -100 (no
    attention mask: causal attention never looks at the pads), one per row."""
    from families import VOCAB
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        doc = torch.randint(3, VOCAB, (int(torch.randint(12, 41, (), generator=g)),), generator=g).tolist()
        pad = 40 - len(doc)
        rows.append({"input_ids": doc + [0] * pad, "labels": doc + [-100] * pad} if padded
                    else {"input_ids": doc})
    return rows


def hf_example():
    """examples/hf/sft.py as the module "hf_sft_example" (tests_dist and examples/gemma2 hold
    other modules named sft)."""
    import importlib.util
    name = "hf_sft_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", "hf", "sft.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def trainer_args(tmp: str, per_device: int, **kw):
    import hf_trainer_workers as HW
    return HW.example.training_args(
        tmp, per_device_train_batch_size=per_device, per_device_eval_batch_size=PER_DEVICE,
        gradient_accumulation_steps=GA, max_steps=STEPS, optim="sgd", learning_rate=0.05,
        max_grad_norm=1.0, dataloader_drop_last=False, **kw)


def sft_args(tmp: str, per_device: int, **kw):
    return hf_example().sft_args(
        tmp, per_device_train_batch_size=per_device, per_device_eval_batch_size=PER_DEVICE,
        gradient_accumulation_steps=GA, max_steps=STEPS, optim="sgd", learning_rate=0.05,
        max_grad_norm=1.0, packing=False, **kw)


def summary(trainer, initial: dict) -> dict:
    """Per logged step: loss and grad norm (TRL's token accuracy too); eval loss; the final
    weights as lists, and how far they moved from `initial`."""
    metrics = trainer.evaluate()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    keys = ("loss", "grad_norm", "mean_token_accuracy")
    weights = {k: v.detach().double() for k, v in trainer.model.state_dict().items()}
    return {"steps": {k: [h[k] for h in steps if k in h] for k in keys},
            "eval_loss": metrics["eval_loss"],
            "moved": max(rel(weights[k], initial[k]) for k in initial),
            "weights": {k: v.flatten().tolist() for k, v in weights.items()}}


def run_trainer(name: str, dp: int, mesh=None, comm=None) -> dict:
    """name "trainer": CPTrainer on packed documents (DataCollatorWithFlattening); "sft":
    CPSFTTrainer on padding-free rows (TRL's padding_free=True, completion-only loss); the
    gpt-oss model on both. Without a mesh: the plain Trainer / SFTTrainer on one process with
    eager attention on the same documents one per padded row (HF's gpt-oss builds its masks
    without position_ids, so its eager attention would let packed documents see each other),
    each micro-step dp x the CP run's per-device batch: the same global batch, as the data is
    read in order."""
    import transformers

    import hf_trainer_workers as HW
    example = hf_example()
    try:
        eager, ours = trainer_model()
        with tempfile.TemporaryDirectory() as tmp:
            one = mesh is None
            per_device = PER_DEVICE * (dp if one else 1)
            cp = {} if one else {"cp_mesh": mesh, "cp_comm": comm}
            if name == "trainer":
                from cp_softcap.integrations.hf_trainer import CPTrainer
                cls = transformers.Trainer if one else CPTrainer
                kw = dict(args=trainer_args(tmp, per_device),
                          train_dataset=text_rows(STEPS * GA * PER_DEVICE * dp, 0, padded=one),
                          eval_dataset=text_rows(3 * PER_DEVICE, 1, padded=one))
                if not one:
                    kw["data_collator"] = transformers.DataCollatorWithFlattening()
            else:
                from trl import SFTTrainer

                from cp_softcap.integrations.trl_sft import CPSFTTrainer
                from gemma2.sft import toy_tokenizer
                cls = SFTTrainer if one else CPSFTTrainer
                train, evaluation = example.datasets()
                kw = dict(args=sft_args(tmp, per_device, padding_free=not one),
                          processing_class=toy_tokenizer(), train_dataset=train, eval_dataset=evaluation)
            model = eager if one else ours
            initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
            trainer = HW.sequential(cls)(model=model, **kw, **cp)
            trainer.train()
            return summary(trainer, initial)
    except Exception:
        return {"error": traceback.format_exc()[-4000:]}


def moe_loss_refusal(mesh):
    """CPTrainer's message for gpt-oss with its MoE load-balancing loss on (None if accepted)."""
    import transformers

    from cp_softcap.integrations.hf_trainer import CPTrainer
    _, ours = trainer_model()
    ours.config.output_router_logits = True
    with tempfile.TemporaryDirectory() as tmp:
        try:
            CPTrainer(model=ours, args=trainer_args(tmp, PER_DEVICE), cp_mesh=mesh,
                      data_collator=transformers.DataCollatorWithFlattening(), train_dataset=text_rows(4, 0))
        except ValueError as e:
            return str(e)
    return None


# ---------------------------------------------------------------- the ranks and the reference

TRAINER_CP = {"trainer": (2, "ring"), "sft": (4, "a2a")}      # name: (cp, comm) over 4 ranks
EXAMPLE_ARGS = ["--family", "gemma3", "--steps", "3"]


def _torchrun_env(rank: int, world: int) -> None:
    """What torchrun sets, for TrainingArguments (accelerate reads it; the process group exists)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def rank_main(rank: int, world: int, families) -> dict:
    _torchrun_env(rank, world)
    t = time.process_time()
    result = model_cases(rank, world, families)
    result["cpu_s"] = {"models": time.process_time() - t}
    t = time.process_time()
    from cp_softcap.integrations.hf_trainer import cp_mesh
    meshes = {cp: cp_mesh(cp) for cp in sorted({cp for cp, _ in TRAINER_CP.values()})}
    result["trainers"] = {name: run_trainer(name, world // cp, meshes[cp], comm)
                          for name, (cp, comm) in TRAINER_CP.items()}
    result["trainers"]["moe_loss_refused"] = moe_loss_refusal(meshes[2])
    result["cpu_s"]["trainers"] = time.process_time() - t
    if rank != 0:
        return {"cpu_s": result["cpu_s"]}
    return result


def example_rank(rank: int, world: int) -> dict:
    _torchrun_env(rank, world)
    summary = hf_example().main(EXAMPLE_ARGS)
    return {**summary, "cpu_s": time.process_time()}


def reference_main(queue) -> None:
    """The one-process runs: the plain trainers at each CP run's dp, and the example at --cp 1."""
    torch.set_num_threads(1)
    try:
        out = {}
        for name, (cp, _) in TRAINER_CP.items():
            out[name] = run_trainer(name, WORLD // cp)
        out["example"] = hf_example().main(EXAMPLE_ARGS + ["--cp", "1"])
        out["cpu_s"] = time.process_time()
        queue.put(("ok", out))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def main(out_dir: str) -> None:
    import logging
    import multiprocessing as mp
    import warnings

    import transformers  # noqa: F401  (imported here once, inherited by every fork)
    import trl  # noqa: F401

    import cp_softcap.integrations.hf  # noqa: F401
    import cp_softcap.integrations.hf_trainer  # noqa: F401
    import cp_softcap.integrations.trl_sft  # noqa: F401
    import hf_models  # noqa: F401
    import hf_trainer_workers  # noqa: F401
    hf_example()
    from families import FAMILIES
    from benchmarks.ranks import failure_text, spawn_ranks
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    start = time.monotonic()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    ref = ctx.Process(target=reference_main, args=(queue,), daemon=True)
    ref.start()
    results = {}
    env = {"CP_SOFTCAP_TIMEOUT": "60", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name, world, fn, args in (("cp", WORLD, rank_main, (FAMILIES,)), ("example", 2, example_rank, ())):
        out, running = spawn_ranks(fn, world, args, ctx=ctx, deadline_s=400, env=env, pg_timeout=120)
        bad = sorted(r for r, (status, _) in out.items() if status != "ok")
        if bad or running:
            results[name] = {"error": failure_text(out[bad[0]]) if bad else f"ranks {running} timed out"}
        else:
            results[name] = out[0][1]
            if name == "cp":
                results[name]["cpu_s_per_rank"] = [out[r][1]["cpu_s"] for r in range(world)]
    try:
        status, value = queue.get(timeout=max(1.0, 400 - (time.monotonic() - start)))
        results["reference"] = value if status == "ok" else {"error": value}
    except Exception:
        results["reference"] = {"error": "the reference process did not report"}
    ref.join(timeout=5)
    if ref.is_alive():
        ref.kill()
    usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    results["cpu_s"] = sum(u.ru_utime + u.ru_stime for u in usage)
    results["cpu_s_launcher"] = usage[0].ru_utime + usage[0].ru_stime      # the imports, mostly
    results["wall_s"] = time.monotonic() - start
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
