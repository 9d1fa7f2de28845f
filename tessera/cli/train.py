"""`tessera train`: train a model from a config file, flags, or both (every flag overrides one field).

    tessera train --model tiny-llama --nproc 2             # the CPU demo: plan, launch 2 ranks, train
    tessera train --config examples/demo.toml              # the same, from a file
    tessera train --config run.toml --steps 20 --lr 1e-3   # the file, two fields overridden
    tessera train --resume runs/tiny-llama/RUN_ID --steps 200     # continue a run (its config, records)
    tessera train --plan plan.json --nproc 8 --data DIR    # execute a plan made with `tessera plan -o`
    torchrun --nnodes 8 --nproc-per-node 8 ... -m tessera train --config examples/llama2-7b-64gpu.toml
    tessera train --init-from HF_DIR --data chat.jsonl --nproc 4   # fine-tune a Hugging Face model

Without a plan, the plan is searched for this machine (`runtime.machine`): a preset GPU's figures,
or on a CPU a quick measured profile of it (cached). A plan made for another machine is refused.
With --nproc N outside torchrun, the resolved config and the plan are written to the run directory
and N processes are started with `torch.distributed.run`, each running `tessera train --config`
of that resolved config. Each run keeps its records in its own directory (`runtime/runs.py`).
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import TesseraError

log = logging.getLogger(__name__)

EPILOG = """\
Every flag overrides the config field named in its help; `--config` files are TOML or YAML with the
sections [model] [data] [plan] [train] [optim] [eval] [checkpoint] [log] [run] (examples/demo.toml).

Each run keeps its records in runs/<name>/<run-id>/ (--out): config.toml (the resolved config:
`tessera train --config` of it reruns the run, planned again for the machine it runs on),
plan.json (the plan it ran), metrics.jsonl (one line per step with the run id) and checkpoints/
(the latest 3: --checkpoint-keep). --resume of the run directory continues it with its config:
same directory, same metrics file, no step twice (flags still override, e.g. --steps, --nproc).

examples:
  tessera train --model tiny-llama --nproc 2 --eval-every 25
  tessera train --config examples/demo.toml --steps 20
  tessera train --resume runs/tiny-llama/RUN_ID --steps 200
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..config import add_config_arguments

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    add_config_arguments(p)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def make_local_plan(model_name: str, nproc: int, workload, cluster=None, model=None, ep: int | None = None):
    """The searched plan for `nproc` local ranks of this machine (`cluster`: default the rough
    built-in CPU figures; MoE layers at expert-parallel degree `ep` when given)."""
    from dataclasses import replace

    from ..search import search
    from ..spec.presets.clusters import local_cpu_cluster
    from .plan import search_options

    cluster = cluster or local_cpu_cluster(nproc)
    model = model or _model_spec(model_name)
    options = search_options(cluster)
    if ep is not None:
        experts = max((layer.num_experts for layer in model.layers), default=0)
        if not experts or experts % ep or nproc % ep:
            raise TesseraError(f"--ep {ep} must divide the model's experts ({experts}) and the {nproc} ranks")
        options = replace(options, ep=ep)
    return search(model, cluster, workload, options=options)


def make_replicated_plan(model_name: str, nproc: int, workload, cluster=None, model=None):
    """Plain data parallelism over `nproc` local ranks (what `--adaptive` runs on)."""
    from ..search import manual_plan
    from ..spec.presets.clusters import local_cpu_cluster

    if workload.global_batch % nproc:
        raise TesseraError(f"--global-batch {workload.global_batch} is not divisible by {nproc} ranks")
    return manual_plan(model or _model_spec(model_name), cluster or local_cpu_cluster(nproc), workload, dp=nproc,
                       micro_batch_size=workload.global_batch // nproc, name="data-parallel")


def _model_spec(name: str):
    from ..spec.hf_config import resolve_model_config
    from ..spec.model import ModelSpec

    return ModelSpec.from_config(resolve_model_config(name))


@dataclass
class Job:
    """A run ready to start: its resolved config, plan, directory and ranks."""

    config: object  # RunConfig
    plan: object  # Plan
    paths: object  # RunPaths
    world: int
    note: str  # where the plan's figures come from


def run(args) -> int:
    from ..config import resolve_config

    _resume_with_its_config(args)
    config, sources = resolve_config(args)
    job = prepare(config, sources)
    if job.world > 1 and not _under_torchrun():
        return _launch(job)
    return _train_here(job)


def _resume_with_its_config(args) -> None:
    """`--resume RUN_DIR` without `--config`: the run's own resolved config is the base."""
    from ..runtime.runs import CONFIG_FILE, run_dir_of

    resume = getattr(args, "cfg__checkpoint__resume", None)
    if resume and not args.config:
        run_dir = run_dir_of(resume)
        if run_dir is not None:
            args.config = str(run_dir / CONFIG_FILE)


# The plan the launcher made, for the ranks it starts (they execute it, they do not plan again).
LAUNCHED_PLAN = "TESSERA_RUN_PLAN"


def prepare(config, sources=None) -> Job:
    """Plan (or load the plan), check it against this machine and the inputs, and name the run's
    directory; every rank of a torchrun job gets rank 0's run id and plan."""
    from ..config import check_plan_agrees
    from ..plan import Plan
    from ..runtime.machine import check_plan_fits_machine, this_machine
    from ..runtime.runs import agree_across_ranks, resolve_run

    under = _under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if under else (config.plan.nproc or 1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under else world
    machine = this_machine()
    _check_inputs(config)  # before planning, which may measure this machine
    if os.environ.get(LAUNCHED_PLAN):
        plan, note = Plan.load(os.environ[LAUNCHED_PLAN]), "the launcher's plan"
    elif config.plan.file:
        plan, note = Plan.load(config.plan.file), f"plan {config.plan.file}"
        if sources is not None:
            check_plan_agrees(config, sources, plan)
    else:
        plan, note = _plan_for_machine(config, machine, world, local_world, under)
    if config.plan.adaptive:
        from ..runtime.adaptive import check_adaptive_plan

        check_adaptive_plan(plan)
    _validate(plan, world, config)
    check_plan_fits_machine(plan, machine, local_world, f"plan {config.plan.file}" if config.plan.file else "the plan")
    config, paths = resolve_run(config, plan.model.name)
    if under and world > 1:
        resolved, plan_json = agree_across_ranks((config.to_dict(), plan.to_json()))
        from ..config import RunConfig

        config, plan = RunConfig.model_validate(resolved, strict=False), Plan.from_json(plan_json)
        config, paths = resolve_run(config, plan.model.name)
    w = plan.workload
    resolved = {"data.global_batch": w.global_batch, "data.seq_len": w.seq_len, "plan.nproc": world}
    if config.plan.file:  # a given plan is the run's copy of it; a searched one is searched again
        resolved.update({"plan.file": str(paths.plan), "model.name": plan.model.name})
    config = config.replace(**resolved)
    return Job(config=config, plan=plan, paths=paths, world=world, note=note)


def _plan_for_machine(config, machine, world: int, local_world: int, under: bool):
    """The plan for this machine: searched (or plain data parallelism for --adaptive)."""
    from ..config import default_shape
    from ..runtime.machine import cluster_for_this_machine
    from ..spec.workload import Workload

    name = config.model.init_from or config.model.name
    model = _model_spec(name)
    batch, seq = default_shape(model.num_params, model.config.max_seq_len if model.config else None)
    workload = Workload(global_batch=config.data.global_batch or batch, seq_len=config.data.seq_len or seq,
                        dtype=machine.default_dtype)
    target = cluster_for_this_machine(config.plan.cluster, machine, world, local_world, model, under)
    profile = config.plan.model_profile or target.model_profile
    if profile is not None:
        from ..profile.apply import apply_model_profile

        model = apply_model_profile(model, profile)
    if config.plan.adaptive:
        return make_replicated_plan(name, world, workload, cluster=target.cluster, model=model), target.note
    return make_local_plan(name, world, workload, cluster=target.cluster, model=model, ep=config.plan.ep), target.note


def _check_inputs(config) -> None:
    """What the run reads, before anything is planned or started: the data, the checkpoint to
    resume, and a Hugging Face directory (its shards, tokenizer and the data it tokenizes)."""
    data, init_from = config.data.path, config.model.init_from
    if data is not None and not (Path(data).is_dir() or (init_from and Path(data).is_file())):
        raise TesseraError(f"data directory {data} does not exist")
    resume = config.checkpoint.resume
    if resume is not None and not Path(resume).exists():
        raise TesseraError(f"checkpoint directory {resume} does not exist")
    if init_from is not None:
        _check_init_from(config)


def _validate(plan, world: int, config) -> None:
    from ..runtime.parallelize import check_plan_supported
    from ..runtime.trainer import _pipeline_available

    check_plan_supported(plan, world, pipeline_available=_pipeline_available())
    if config.model.init_from is not None:
        from ..models.hf_load import hf_model_config, same_architecture

        cfg = hf_model_config(config.model.init_from)
        if plan.model.config is not None and not same_architecture(cfg, plan.model.config):
            raise TesseraError(f"the plan is for the model {plan.model.name}, not for the checkpoint in "
                               f"{config.model.init_from} (its config.json describes another architecture)")
    for package, asked in (("tensorboard", config.log.tensorboard), ("wandb", config.log.wandb)):
        if asked and not _installed(package) and int(os.environ.get("RANK", "0")) == 0 and not _under_torchrun():
            print(f"log.{package} is on, but {package} is not installed: logging to metrics.jsonl only", flush=True)


def _installed(package: str) -> bool:
    from importlib.util import find_spec

    return find_spec(package) is not None


def _check_init_from(config) -> None:
    """Before any process starts: the directory and its config.json, its shards are all there, its
    tokenizer fits the embedding, and the data tokenizes (the ranks then read the token cache)."""
    from ..models.hf_load import hf_model_config, stored_tensors

    init_from = config.model.init_from
    cfg = hf_model_config(init_from)
    stored_tensors(init_from)
    if not config.data.synthetic:
        from ..runtime.finetune_data import finetune_stream
        from ..runtime.hf_tokenizer import HFTokenizer

        tokenizer = HFTokenizer(init_from)
        tokenizer.check_fits(cfg.vocab_size)
        finetune_stream(config.data.path, tokenizer)  # tokenized (and cached) once, bad samples refused, here


def _write_records(job: Job) -> None:
    """The run directory with its resolved config and plan (rank 0 or the launcher)."""
    from ..config import to_toml
    from ..runtime.runs import write_text_atomic

    job.paths.dir.mkdir(parents=True, exist_ok=True)
    header = (f"Resolved config of run {job.paths.run_id}: every field as the run used it.\n"
              f"Rerun it with: tessera train --config {job.paths.config}")
    write_text_atomic(job.paths.config, to_toml(job.config, header))
    write_text_atomic(job.paths.plan, job.plan.to_json() + "\n")


def _headline(job: Job) -> str:
    p = job.plan.prediction
    pred = f": predicted {p.step_time_s:.2f} s/step, MFU {100 * p.mfu:.1f}%" if p else ""
    return (f"run {job.paths.run_id} in {job.paths.dir}\nplan '{job.plan.name}' for {job.world} "
            f"rank{'s' * (job.world > 1)} on {job.note}{pred}")


def _launch(job: Job) -> int:
    """Start `world` local ranks with torchrun, each running `tessera train --config` of the
    resolved config in the run directory."""
    _write_records(job)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={job.world}",
           "-m", "tessera", "train", "--config", str(job.paths.config)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env[LAUNCHED_PLAN] = str(job.paths.plan)
    print(_headline(job) + f"\nlaunching torchrun with {job.world} processes", flush=True)
    return subprocess.call(cmd, env=env)


def train_config(job: Job):
    """The trainer's `TrainConfig` of a job's resolved config."""
    from ..runtime.optim import OptimConfig
    from ..runtime.runs import checkpoint_source
    from ..runtime.trainer import TrainConfig

    c, paths = job.config, job.paths
    o = c.optim
    optim = OptimConfig(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                        warmup_steps=o.warmup_steps, total_steps=c.train.steps, min_lr_ratio=o.min_lr_ratio,
                        decay=o.decay, grad_clip=o.grad_clip)
    wandb = None
    if c.log.wandb:
        wandb = dict(project=c.log.wandb_project, name=f"{c.run.name}/{paths.run_id}", id=paths.run_id,
                     dir=str(paths.dir), config=c.to_dict())
    resume = checkpoint_source(c.checkpoint.resume, str(paths.checkpoints)) if c.checkpoint.resume else None
    return TrainConfig(
        plan=job.plan, steps=c.train.steps, seed=c.train.seed, data=c.data.path, synthetic_data=c.data.synthetic,
        optim=optim, metrics_path=str(paths.metrics),
        tensorboard_dir=str(paths.tensorboard) if c.log.tensorboard else None, log_every=c.log.every,
        compile=c.train.compile, checkpoint_dir=str(paths.checkpoints), checkpoint_every=c.checkpoint.every,
        resume=resume, adaptive=c.plan.adaptive, long_documents=c.plan.long_documents, init_from=c.model.init_from, run_id=paths.run_id, wandb=wandb,
        checkpoint_keep=c.checkpoint.keep, checkpoint_final=c.checkpoint.final, eval_every=c.eval.every,
        eval_batches=c.eval.batches, eval_fraction=c.eval.fraction)


def _train_here(job: Job) -> int:
    from ..runtime.trainer import Trainer
    from .train_log import make_log

    logging.basicConfig(level=logging.WARNING)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if rank0:
        _write_records(job)
    progress = make_log(job.config.log.progress, job.config.train.steps) if rank0 else None
    trainer = Trainer(train_config(job), on_step=progress.update if progress else None,
                      on_event=progress.event if progress else None)
    try:
        if progress:
            layers = job.plan.layers[1].describe() if len(job.plan.layers) > 1 else job.plan.layers[0].describe()
            if job.plan.pipeline.degree > 1:
                layers = f"pp{job.plan.pipeline.degree} {job.plan.pipeline.schedule.value}, {layers}"
            headline = "" if os.environ.get(LAUNCHED_PLAN) else _headline(job)  # the launcher said it
            progress.start(f"{headline}\n" * bool(headline) + f"training {job.plan.model.name} on "
                           f"{trainer.world_size} rank{'s' * (trainer.world_size > 1)} ({layers} ...)", trainer.step)
        records = trainer.train()
    finally:
        if progress:
            progress.stop()
        trainer.close()
    if progress and records:
        _summary(records, job)
    return 0


def _summary(records, job: Job) -> None:
    from rich.console import Console
    from rich.table import Table

    plan = job.plan
    steady = records[1:] or records
    step_time = sum(r.step_time_s for r in steady) / len(steady)
    table = Table(title=f"{plan.model.name}: steps {records[0].step}-{records[-1].step}")
    for col in ("first loss", "last loss", "step time (s)", "predicted (s)", "tokens/s", "MFU", "peak mem / rank (MiB)"):
        table.add_column(col, justify="right")
    last = records[-1]
    table.add_row(f"{records[0].loss:.4f}", f"{last.loss:.4f}", f"{step_time:.3f}",
                  f"{last.predicted_step_time_s:.3f}" if last.predicted_step_time_s else "-",
                  f"{plan.workload.tokens_per_step / step_time:,.0f}",
                  f"{100 * last.mfu:.2f}%" if last.mfu is not None else "-",
                  " ".join(f"{m / 2**20:,.0f}" for m in last.peak_memory_bytes))
    Console().print(table)
    if last.moe:
        Console().print(_moe_table(last.moe))
    print(f"records: {job.paths.dir} (config.toml, plan.json, metrics.jsonl, checkpoints/)", flush=True)


def _moe_table(moe: dict):
    """Token-slots per expert of each MoE block and the all-to-all volume, per step (last logged)."""
    from rich.table import Table

    table = Table(title=f"routing per step: all-to-all {moe['a2a_bytes'] / 2**20:,.2f} MiB, "
                        f"router losses {moe['aux_loss']:.4f}")
    table.add_column("block", justify="right")
    table.add_column("token-slots per expert", justify="left")
    table.add_column("max / mean", justify="right")
    for block, counts in moe["tokens_per_expert"].items():
        mean = sum(counts) / max(1, len(counts))
        table.add_row(block, " ".join(str(c) for c in counts), f"{max(counts) / mean:.2f}" if mean else "-")
    return table
