"""`tessera train`: train a model with a plan.

    tessera train --model tiny-llama --nproc 4          # plan for 4 local ranks, launch torchrun, train
    torchrun --nproc-per-node 8 -m tessera train --plan plan.json --data DIR --steps 1000 \\
             --checkpoint-dir ckpt --checkpoint-every 100
    tessera train ... --resume ckpt                     # continue (another plan or world size too)
    tessera train --init-from HF_DIR --data chat.jsonl --nproc 4   # fine-tune a Hugging Face model

Without --plan, the plan is searched for the local ranks (`tessera.search`), or, where the
search is not available, made by hand as plain data parallelism. With --nproc N outside torchrun,
the plan is written to the run directory and N processes are launched with
`torch.distributed.run`, each running `tessera train --plan ...`.

With --init-from HF_DIR (config.json, safetensors shards, tokenizer.json), the plan is made for
that model, each rank reads its shards of the weights from the files (sharded plans build the
model on the meta device, so no rank holds it whole), and text data is tokenized with the model's
own tokenizer and chat template (`runtime/finetune_data.py`).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ..errors import TesseraError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "tiny-llama"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("what to train")
    src.add_argument("--plan", help="plan JSON (from `tessera plan -o`); default: plan for the local ranks")
    src.add_argument("--model", default=None, help=f"model preset or HF config.json when planning (default {DEFAULT_MODEL})")
    src.add_argument("--nproc", type=int, default=None, help="local ranks: launch torchrun with this many processes")
    src.add_argument("--global-batch", type=int, default=8, help="sequences per step when planning (default 8)")
    src.add_argument("--seq-len", type=int, default=128, help="tokens per sequence when planning (default 128)")
    src.add_argument("--init-from", default=None, metavar="HF_DIR",
                     help="start from a Hugging Face checkpoint directory (its weights, tokenizer and chat template)")
    src.add_argument("--data", default=None,
                     help="a .txt/.jsonl/.bin/.npy file or a directory of them (default: Shakespeare); with "
                          "--init-from, JSONL lines may be {\"text\": ...} or {\"messages\": [...]} (chat)")
    src.add_argument("--synthetic-data", action="store_true", help="train on seeded random tokens")
    run = p.add_argument_group("how long and how")
    run.add_argument("--steps", type=int, default=100)
    run.add_argument("--lr", type=float, default=3e-4)
    run.add_argument("--warmup", type=int, default=10, help="warmup steps of the LR schedule")
    run.add_argument("--grad-clip", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--compile", action="store_true", help="torch.compile each block")
    run.add_argument("--adaptive", action="store_true",
                     help="per-step sequence-parallel groups for each batch's documents (needs a replicated "
                          "data-parallel plan; the default plan is one)")
    out = p.add_argument_group("outputs")
    out.add_argument("--out", default=None, help="run directory for plan.json and metrics.jsonl (default runs/<model>)")
    out.add_argument("--checkpoint-dir", default=None)
    out.add_argument("--checkpoint-every", type=int, default=0)
    out.add_argument("--resume", default=None,
                     help="checkpoint directory to continue from (its latest valid checkpoint), a step-N "
                          "directory in it, or 'auto': --checkpoint-dir's latest valid one if there is one")
    out.add_argument("--log-every", type=int, default=1)
    out.add_argument("--check", action="store_true",
                     help="check the flags, the plan and the data (as the ranks would), then stop: start nothing")
    from . import launch

    launch.add_arguments(p)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _workload(args):
    from ..spec.workload import Workload

    return Workload(global_batch=args.global_batch, seq_len=args.seq_len, dtype="fp32")


def _local_cluster(nproc: int, nodes: int = 1):
    """`nproc` CPU ranks of this machine, as `nodes` nodes of nproc / nodes ranks."""
    from ..spec.presets.clusters import local_cpu_cluster

    cluster = local_cpu_cluster(nproc)
    if nodes > 1:
        cluster = cluster.model_copy(update={"num_nodes": nodes, "gpus_per_node": nproc // nodes,
                                             "name": f"local cpu {nodes}x{nproc // nodes}"})
    return cluster


def make_local_plan(model_name: str, nproc: int, workload, nodes: int = 1):
    """The searched plan for `nproc` ranks of this machine (as `nodes` nodes)."""
    from ..search import search
    from ..spec.hf_config import resolve_model_config
    from ..spec.model import ModelSpec

    model = ModelSpec.from_config(resolve_model_config(model_name))
    return search(model, _local_cluster(nproc, nodes), workload)


def make_replicated_plan(model_name: str, nproc: int, workload, nodes: int = 1):
    """Plain data parallelism over `nproc` local ranks (what `--adaptive` runs on)."""
    from ..search import manual_plan
    from ..spec.hf_config import resolve_model_config
    from ..spec.model import ModelSpec

    if workload.global_batch % nproc:
        raise TesseraError(f"--global-batch {workload.global_batch} is not divisible by --nproc {nproc}")
    model = ModelSpec.from_config(resolve_model_config(model_name))
    return manual_plan(model, _local_cluster(nproc, nodes), workload, dp=nproc,
                       micro_batch_size=workload.global_batch // nproc, name="data-parallel")


def _validate(plan, world: int, args) -> None:
    from ..runtime.parallelize import check_plan_supported
    from ..runtime.trainer import _pipeline_available

    check_plan_supported(plan, world, pipeline_available=_pipeline_available())
    from .train_checks import check_plan_sizes

    check_plan_sizes(plan)
    if args.data is not None and not (Path(args.data).is_dir() or (args.init_from and Path(args.data).is_file())):
        raise TesseraError(f"data directory {args.data} does not exist")
    if args.init_from is not None:
        _check_init_from(plan, args)
    if args.resume not in (None, "auto") and not Path(args.resume).exists():
        raise TesseraError(f"checkpoint directory {args.resume} does not exist")
    if args.resume == "auto" and not args.checkpoint_dir:
        raise TesseraError("--resume auto needs --checkpoint-dir (where the checkpoints are)")


def _child_argv(args, plan_path: Path, metrics: Path) -> list[str]:
    argv = ["train", "--plan", str(plan_path), "--steps", str(args.steps), "--lr", str(args.lr),
            "--warmup", str(args.warmup), "--grad-clip", str(args.grad_clip), "--seed", str(args.seed),
            "--out", str(metrics.parent), "--log-every", str(args.log_every)]
    for flag, value in (("--data", args.data), ("--checkpoint-dir", args.checkpoint_dir),
                        ("--resume", args.resume), ("--init-from", args.init_from)):
        if value is not None:
            argv += [flag, value]
    if args.checkpoint_every:
        argv += ["--checkpoint-every", str(args.checkpoint_every)]
    argv += [flag for flag, on in (("--compile", args.compile), ("--synthetic-data", args.synthetic_data),
                                   ("--adaptive", args.adaptive)) if on]
    from . import launch

    return argv + launch.child_flags(args)


def run(args) -> int:
    if _under_torchrun():  # a rank: die with the agent, report how it ended (runtime/resilience.py)
        from ..runtime.resilience import bind_to_parent, run_worker

        bind_to_parent()
        return run_worker(lambda: _run(args))
    return _run(args)


def _run(args) -> int:
    from ..plan import Plan
    from . import launch
    from .train_checks import check_flags

    check_flags(args)
    launch.check(args)

    if args.plan and args.model:
        raise TesseraError("give either --plan or --model (a plan already names its model)")
    if args.init_from and args.model:
        raise TesseraError("give either --init-from or --model (the checkpoint's config.json is the model)")
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else (args.nproc or 1) * args.nnodes
    model = args.init_from or args.model or DEFAULT_MODEL
    if args.init_from:
        from ..models.hf_load import hf_model_config

        hf_model_config(args.init_from)  # the directory, config.json and its features, in one line
    if args.plan:
        plan = Plan.load(args.plan)
    elif args.adaptive:
        plan = make_replicated_plan(model, world, _workload(args), args.nnodes)
    else:
        plan = make_local_plan(model, world, _workload(args), args.nnodes)
    if args.adaptive:
        from ..runtime.adaptive import check_adaptive_plan

        check_adaptive_plan(plan)
    _validate(plan, world, args)
    out = Path(args.out or Path("runs") / plan.model.name)
    if args.check:
        from .train_checks import check_data

        check_data(plan, args)
        print(f"checked: plan '{plan.name}' for {world} ranks ({plan.layers[1].describe()} ...), the flags "
              "and the data are accepted; nothing started")
        return 0
    if world > 1 and not _under_torchrun():
        return _launch(args, plan, args.nproc or 1, out)
    return _train_here(args, plan, out)


def _check_init_from(plan, args) -> None:
    """Before any process starts: the plan is for this checkpoint, its shards are all there, its
    tokenizer fits the embedding, and the data tokenizes (the ranks then read the token cache)."""
    from ..models.hf_load import hf_model_config, same_architecture, stored_tensors

    cfg = hf_model_config(args.init_from)
    if plan.model.config is not None and not same_architecture(cfg, plan.model.config):
        raise TesseraError(f"the plan is for the model {plan.model.name}, not for the checkpoint in "
                           f"{args.init_from} (its config.json describes another architecture)")
    stored_tensors(args.init_from)
    if not args.synthetic_data:
        from ..runtime.finetune_data import finetune_stream
        from ..runtime.hf_tokenizer import HFTokenizer

        tokenizer = HFTokenizer(args.init_from)
        tokenizer.check_fits(cfg.vocab_size)
        finetune_stream(args.data, tokenizer)  # tokenized (and cached) once, bad samples refused, here


def _launch(args, plan, nproc: int, out: Path) -> int:
    """Start `nproc` local ranks under torchrun's elastic agent, each running `tessera train --plan`
    (`cli/launch.py`: restarts, rendezvous across nodes, one-line errors)."""
    from . import launch

    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    plan.save(plan_path)
    print(f"plan '{plan.name}' for {plan.world_size} ranks written to {plan_path}; launching {nproc} local ranks "
          f"(restarts: {args.max_restarts})", flush=True)
    return launch.launch(args, nproc, out, _child_argv(args, plan_path, out / "metrics.jsonl"))


def _train_here(args, plan, out: Path) -> int:
    from ..runtime.optim import OptimConfig
    from . import launch
    from ..runtime.trainer import TrainConfig, Trainer

    logging.basicConfig(level=logging.WARNING)
    config = TrainConfig(
        plan=plan, steps=args.steps, seed=args.seed, data=args.data, synthetic_data=args.synthetic_data,
        optim=OptimConfig(lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps, grad_clip=args.grad_clip),
        metrics_path=str(out / "metrics.jsonl"), tensorboard_dir=str(out / "tensorboard"),
        log_every=args.log_every, compile=args.compile, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume, adaptive=args.adaptive,
        init_from=args.init_from, **launch.runtime_options(args, out))
    progress = _Progress(args.steps) if int(os.environ.get("RANK", 0)) == 0 else None
    trainer = Trainer(config, on_step=progress.update if progress else None)
    try:
        if progress:
            progress.start(plan, trainer.world_size, trainer.step)
        records = trainer.train()
    finally:
        if progress:
            progress.stop()
        trainer.close()
    if progress and records:
        _summary(records, plan, out)
    return 0


class _Progress:
    """A rich progress bar with the last step's loss, throughput, MFU, memory and the prediction."""

    def __init__(self, steps: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.steps = steps
        self.task = None

    def start(self, plan, world: int, step: int) -> None:
        self.progress.console.print(f"training {plan.model.name} with plan '{plan.name}' on {world} ranks "
                                    f"({plan.layers[1].describe()} ...)")
        self.progress.start()
        self.task = self.progress.add_task("train", total=self.steps, completed=step, info="")

    def update(self, r) -> None:
        pred = f" pred {r.predicted_step_time_s:.2f}s" if r.predicted_step_time_s else ""
        mfu = f" mfu {100 * r.mfu:.1f}%" if r.mfu is not None else ""
        mem = max(r.peak_memory_bytes) / 2**20 if r.peak_memory_bytes else 0
        info = (f"loss {r.loss:.4f} | {r.tokens_per_s:,.0f} tok/s{mfu} | step {r.step_time_s:.2f}s{pred} "
                f"| peak {mem:,.0f} MiB")
        self.progress.update(self.task, completed=r.step, info=info)

    def stop(self) -> None:
        self.progress.stop()


def _summary(records, plan, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    steady = records[1:] or records
    step_time = sum(r.step_time_s for r in steady) / len(steady)
    table = Table(title=f"{plan.model.name}: {len(records)} steps")
    for col in ("first loss", "last loss", "step time (s)", "predicted (s)", "tokens/s", "MFU", "peak mem / rank (MiB)"):
        table.add_column(col, justify="right")
    last = records[-1]
    table.add_row(f"{records[0].loss:.4f}", f"{last.loss:.4f}", f"{step_time:.3f}",
                  f"{last.predicted_step_time_s:.3f}" if last.predicted_step_time_s else "-",
                  f"{plan.workload.tokens_per_step / step_time:,.0f}",
                  f"{100 * last.mfu:.2f}%" if last.mfu is not None else "-",
                  " ".join(f"{m / 2**20:,.0f}" for m in last.peak_memory_bytes))
    Console().print(table)
    Console().print(f"metrics: {out / 'metrics.jsonl'}")
