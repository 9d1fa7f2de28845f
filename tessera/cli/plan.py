"""`tessera plan`: search the fastest hybrid-parallel plan that fits memory, or evaluate one by hand.

    tessera plan                                   # the built-in default job (printed)
    tessera plan --model llama3-70b --gpus 1024 --global-batch 1024 --seq-len 8192 -o plan.json
    tessera plan --model path/to/config.json --compare
    tessera plan --dp 4 --tp 2 --pp 2 ...          # a hand-made plan, same cost model
    tessera plan --cluster cluster.json --model-profile model-profile.json ...

Prints the plan with rich; `-o` writes the versioned plan JSON, `--json` prints it to stdout.
No torch import.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import TesseraError

DEFAULT_MODEL = "llama2-7b"
DEFAULT_GPUS = 64
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_GPU = "h100-80gb"

# Flags that make a hand-made plan; None means "not given".
MANUAL_FLAGS = ("dp", "tp", "pp", "sp", "sp_degree", "zero", "dp_shard", "recompute", "offload",
                "ep", "schedule", "virtual_stages", "micro_batch_size", "cp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (f"default job: {DEFAULT_MODEL} on {DEFAULT_GPUS // DEFAULT_GPUS_PER_NODE} nodes x "
                f"{DEFAULT_GPUS_PER_NODE} {DEFAULT_GPU}, global batch 512 x 4096 tokens in bf16. The global batch "
                "and sequence length default by model, as in `tessera train`: 8 x 128 for models under 100M "
                "parameters, else 512 x 4096 (capped at the model's maximum).")
    what = p.add_argument_group("what to train")
    what.add_argument("--model", default=DEFAULT_MODEL,
                      help=f"preset name (e.g. llama3-70b) or a Hugging Face config.json (file or directory) "
                           f"(default: {DEFAULT_MODEL})")
    what.add_argument("--model-profile", metavar="JSON", help="measured model profile (tessera profile model)")
    what.add_argument("--global-batch", type=int, metavar="N", default=None,
                      help="sequences per step (default: 8 for models under 100M parameters, else 512)")
    what.add_argument("--seq-len", type=int, metavar="N", default=None,
                      help="tokens per sequence (default: 128 for models under 100M parameters, else 4096, "
                           "capped at the model's maximum)")
    what.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                      help="training precision (default: the model profile's; else fp32 on a CPU cluster, "
                           "bf16 on GPUs)")
    what.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="(default: adamw)")
    where = p.add_argument_group("on what")
    where.add_argument("--gpus", type=int, metavar="N", default=None, help=f"number of GPUs (default {DEFAULT_GPUS})")
    where.add_argument("--gpus-per-node", type=int, metavar="N", default=None,
                       help=f"GPUs per node (default {DEFAULT_GPUS_PER_NODE})")
    where.add_argument("--gpu", default=None, help=f"GPU kind (default {DEFAULT_GPU})")
    where.add_argument("--memory-margin", type=float, metavar="FRACTION", default=None,
                       help="share of device memory the planner leaves free (default 0.05, "
                            "on top of the allocator's fragmentation and the framework reserve)")
    where.add_argument("--cluster", metavar="JSON", help="cluster spec JSON (tessera profile hardware); "
                                                         "--gpus resizes it")
    manual = p.add_argument_group("a hand-made plan (any of these skips the search)")
    manual.add_argument("--dp", type=int, metavar="N", help="data-parallel degree (default: what the GPUs leave)")
    manual.add_argument("--tp", type=int, metavar="N", help="tensor-parallel degree")
    manual.add_argument("--pp", type=int, metavar="N", help="pipeline-parallel degree")
    manual.add_argument("--sp", choices=("none", "megatron", "ulysses"), help="sequence parallelism")
    manual.add_argument("--sp-degree", type=int, metavar="N", help="Ulysses degree")
    manual.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    manual.add_argument("--dp-shard", type=int, metavar="N", help="hybrid sharding group size (HSDP)")
    manual.add_argument("--recompute", choices=("none", "selective", "full"), help="activation recompute")
    manual.add_argument("--offload", action="store_true", default=None, help="offload optimizer state")
    manual.add_argument("--ep", type=int, metavar="N", help="expert-parallel degree")
    manual.add_argument("--cp", type=int, metavar="N",
                        help="context-parallel degree (ring attention over N ranks, load-balanced causal split)")
    manual.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"),
                        help="pipeline schedule")
    manual.add_argument("--virtual-stages", type=int, metavar="N", help="model chunks per pipeline rank")
    manual.add_argument("--micro-batch-size", type=int, metavar="N", help="sequences per micro-batch")
    out = p.add_argument_group("output")
    out.add_argument("--compare", action="store_true", help="show the plan beside the baselines")
    out.add_argument("-o", "--out", dest="output", metavar="PLAN_JSON", help="write the plan JSON here")
    out.add_argument("--output", dest="output", help=argparse.SUPPRESS)  # the earlier name
    out.add_argument("--json", action="store_true", help="print the plan JSON to stdout (no tables)")
    out.add_argument("--expert-offload", type=float, metavar="HOST_TFLOPS", default=None,
                     help="APTMoE: experts in host memory, each computed on the GPU or the host (this many "
                          "TFLOP/s of host compute per GPU, the cluster's host bandwidth): print the decision")


def build_cluster(args: argparse.Namespace):
    from ..search.limits import check_search_size

    check_search_size(num_gpus=args.gpus)  # before anything counts them
    cluster = _base_cluster(args)
    margin = getattr(args, "memory_margin", None)
    if margin is not None:
        if not 0.0 <= margin < 1.0:
            raise TesseraError(f"--memory-margin must be a fraction in [0, 1), got {margin}")
        cluster = cluster.model_copy(update={"memory_margin": margin})
    return cluster


def _base_cluster(args: argparse.Namespace):
    from ..spec.loaders import load_cluster
    from ..spec.presets import make_cluster

    if args.cluster:
        if args.gpu or args.gpus_per_node:
            raise TesseraError("--cluster already gives the GPU kind and GPUs per node; "
                               "drop --gpu/--gpus-per-node (use --gpus to resize it)")
        cluster = load_cluster(args.cluster)
        return cluster.with_gpus(args.gpus) if args.gpus else cluster
    return make_cluster(args.gpu or DEFAULT_GPU, DEFAULT_GPUS if args.gpus is None else args.gpus,
                        args.gpus_per_node or DEFAULT_GPUS_PER_NODE)


def build_model(args: argparse.Namespace):
    from ..search.limits import check_search_size
    from ..spec.hf_config import resolve_model_config
    from ..spec.model import ModelSpec

    config = resolve_model_config(args.model)
    check_search_size(num_layers=config.num_layers + 2)  # + embedding and head; before building them
    model = ModelSpec.from_config(config)
    if args.model_profile:
        from ..profile.apply import apply_model_profile

        model = apply_model_profile(model, args.model_profile)
    return model


def default_dtype(args: argparse.Namespace, cluster) -> str:
    """The model profile's dtype (its timings are of it), else fp32 on a CPU (what a CPU computes
    in), else bf16."""
    if getattr(args, "dtype", None):
        return args.dtype
    if getattr(args, "model_profile", None):
        from ..profile.apply import load_model_profile

        dtype = load_model_profile(args.model_profile).dtype
        if dtype in ("bf16", "fp16", "fp32"):
            return dtype
    return "fp32" if cluster.device.name.lower().startswith("cpu") else "bf16"


def build_workload(args: argparse.Namespace, model, dtype: str = "bf16"):
    from ..config import default_shape
    from ..spec.workload import Workload

    config = model.config
    batch, seq = default_shape(model.num_params, config.max_seq_len if config else None)
    seq_len = args.seq_len
    global_batch = args.global_batch if args.global_batch is not None else batch
    if seq_len is None:
        seq_len = seq
    elif config is not None and config.position == "learned" and seq_len > config.max_seq_len:
        raise TesseraError(f"--seq-len {seq_len} is longer than {model.name}'s {config.max_seq_len} "
                           "learned positions")
    if global_batch <= 0 or seq_len <= 0:
        raise TesseraError(f"--global-batch and --seq-len must be positive (got {global_batch}, {seq_len})")
    from ..search.limits import check_search_size

    check_search_size(global_batch=global_batch)
    return Workload(global_batch=global_batch, seq_len=seq_len, dtype=dtype, optimizer=args.optimizer)


def manual_options(args: argparse.Namespace) -> dict:
    """The hand-made plan's degrees the user gave (empty: search instead)."""
    given = {k: getattr(args, k) for k in MANUAL_FLAGS if getattr(args, k) is not None}
    for k, v in given.items():
        if isinstance(v, int) and not isinstance(v, bool) and v < (0 if k in ("zero", "dp_shard") else 1):
            least = "0 or more" if k == "dp_shard" else "a positive integer"
            raise TesseraError(f"--{k.replace('_', '-')} must be {least}, not {v}")
    if "offload" in given:
        given["offload"] = bool(given["offload"])
    return given


def check_batch_divides(workload, cluster, opts: dict) -> None:
    """The global batch must split into dp replicas of micro-batches: say by what it does not divide."""
    if opts.get("sp") == "ulysses" and opts.get("sp_degree", 1) < 2:
        raise TesseraError("--sp ulysses needs --sp-degree N with N >= 2 (the ranks a sequence is split over)")
    tp, pp, cp = opts.get("tp", 1), opts.get("pp", 1), opts.get("cp", 1)
    sp_degree = opts.get("sp_degree", 1)
    per_stage, rest = divmod(cluster.num_gpus, pp * tp * sp_degree * cp)
    if rest or per_stage == 0:
        degrees = f"pp {pp} x tp {tp} x sp {sp_degree}" + (f" x cp {cp}" if cp > 1 else "")
        raise TesseraError(f"{degrees} = {pp * tp * sp_degree * cp} does not divide {cluster.num_gpus} GPUs")
    dp = opts.get("dp") or per_stage
    mbs = opts.get("micro_batch_size", 1)
    if workload.global_batch % (dp * mbs):
        raise TesseraError(f"global batch {workload.global_batch} is not divisible by dp {dp} x "
                           f"micro-batch size {mbs} = {dp * mbs}")


def search_options(cluster):
    """The search space for `cluster`: a CPU has no host memory apart from its own, so nothing is
    offloaded there (it would save no memory and add copies)."""
    from ..search.space import SearchOptions

    return SearchOptions(allow_offload=not cluster.device.name.lower().startswith("cpu"))


def evaluated(plan):
    """The plan with its prediction (hand-made plans and baselines may come without one)."""
    if plan.prediction is not None:
        return plan
    from ..cost import evaluate

    return plan.model_copy(update={"prediction": evaluate(plan)})


def make_plan(args, model, cluster, workload, console):
    opts = manual_options(args)
    if opts:
        check_batch_divides(workload, cluster, opts)
        from pydantic import ValidationError

        from ..search import manual_plan
        from ..spec.jsonio import first_validation_error

        start = time.perf_counter()
        try:
            plan = evaluated(manual_plan(model, cluster, workload, **opts))
        except ValidationError as e:  # pydantic's message spans lines; the CLI answers in one
            raise TesseraError(f"invalid hand-made plan: {first_validation_error(e)}") from None
        return plan, time.perf_counter() - start
    from ..search import search

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        progress.add_task(f"searching plans for {model.name} on {cluster.num_gpus} GPUs", total=None)
        plan = evaluated(search(model, cluster, workload, search_options(cluster)))
    return plan, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    from ..report.tables import comparison_table, make_console, render_plan

    # Tables go to stdout, unless --json keeps stdout for the plan; the spinner always to stderr.
    out = make_console(stderr=args.json)
    status = make_console(stderr=True)
    manual_options(args)  # refuse bad flags before printing anything
    model = build_model(args)
    cluster = build_cluster(args)
    workload = build_workload(args, model, default_dtype(args, cluster))
    if _is_default_job(args) and not args.json:
        out.print(f"[dim]built-in default job: {model.name} on {cluster.name}, global batch "
                  f"{workload.global_batch} x {workload.seq_len} tokens (see tessera plan --help)[/dim]")
    _check_profile_matches(args, cluster, workload, out)
    plan, elapsed = make_plan(args, model, cluster, workload, status)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        plan.save(args.output)
    if args.json:
        sys.stdout.write(plan.to_json() + "\n")
        return 0
    render_plan(plan, out)
    if args.compare:
        from ..search import baseline_plans

        baselines = [evaluated(b) for b in baseline_plans(model, cluster, workload)]
        out.print()
        out.print(comparison_table(plan, baselines))
    if args.expert_offload is not None:
        out.print(expert_offload_summary(plan, args.expert_offload))
    from ..search.explain import bubble_warning

    warning = bubble_warning(plan)
    if warning and warning not in plan.search.explanation:  # a searched plan's explanation says it already
        out.print(f"[bold yellow]{warning}[/bold yellow]")
    out.print(f"[dim]planned in {elapsed:.2f} s[/dim]")
    if args.output:
        out.print(f"wrote {args.output} (show it with: tessera show {args.output})")
    return 0


def expert_offload_summary(plan, host_tflops: float) -> str:
    """APTMoE's decision for the MoE layers of the plan's first stage (cost/expert_offload.py)."""
    from ..cost.expert_offload import GPU, HostSpec, plan_expert_offload

    if host_tflops <= 0:
        raise TesseraError(f"--expert-offload {host_tflops}: host TFLOP/s must be > 0")
    start, end = plan.pipeline.stages[0]
    layers = plan.model.layers[start:end]
    if not any(layer.num_experts for layer in layers):
        raise TesseraError(f"--expert-offload: {plan.model.name} has no experts on the first pipeline stage")
    host = HostSpec(flops=host_tflops * 1e12, link_bandwidth=plan.cluster.host_bandwidth)
    tokens = plan.micro_batch_size * plan.workload.seq_len
    decision = plan_expert_offload(plan.model.model_copy(update={"layers": layers}), plan.cluster, plan.workload,
                                   host, tokens, micro_batches=plan.num_micro_batches)
    on_gpu = sum(w == GPU for layer in decision.layers for w in layer.where)
    total = sum(len(layer.where) for layer in decision.layers)
    return (f"expert offload (APTMoE, predicted, first stage, experts in host memory): {decision.step_s:.3f} s of "
            f"expert layers per step, {on_gpu} of {total} experts brought to the GPU; bringing every expert "
            f"{decision.offload_all_s:.3f} s ({decision.offload_all_s / decision.step_s:.2f}x), every expert on the "
            f"host {decision.host_all_s:.3f} s")


def _check_profile_matches(args, cluster, workload, out) -> None:
    """A model profile's timings are of its dtype and of its ranks sharing the machine: refuse
    another dtype; say so when a CPU cluster runs another number of ranks per node."""
    if not args.model_profile:
        return
    from ..profile.apply import load_model_profile

    profile = load_model_profile(args.model_profile)
    if profile.dtype != workload.dtype:
        raise TesseraError(f"the model profile {args.model_profile} timed {profile.dtype}, not {workload.dtype}: "
                           f"plan with --dtype {profile.dtype}, or profile again with --dtype {workload.dtype}")
    cpu = cluster.device.name.lower().startswith("cpu")
    if cpu and profile.ranks_measuring != cluster.gpus_per_node and not args.json:
        out.print(f"[dim]note: the model profile was measured by {profile.ranks_measuring} ranks sharing this "
                  f"CPU, the cluster runs {cluster.gpus_per_node} per node; profile the model with torchrun "
                  f"--nproc-per-node {cluster.gpus_per_node} for timings of that many[/dim]")


def _is_default_job(args: argparse.Namespace) -> bool:
    return (args.model == DEFAULT_MODEL and args.gpus is None and args.cluster is None
            and args.gpu is None and args.global_batch is None and args.seq_len is None)
