"""`tessera <verb>`: each verb lives in its own module with `add_arguments(parser)` and `run(args)`.

The CLI is thin: parse, call the library, format for people. Bad input (a `TesseraError` or a
`ValueError` raised by validation) is answered in one line with exit code 2; set TESSERA_DEBUG=1
for the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# verb -> (module, one-line help). Modules are imported only for the verb that runs, so that
# `tessera plan` never imports torch.
VERBS: dict[str, tuple[str, str]] = {
    "plan": ("tessera.cli.plan", "find the fastest way to split a model over GPUs that fits in memory"),
    "show": ("tessera.cli.show", "show a plan as tables and pictures (pipeline timeline, memory)"),
    "train": ("tessera.cli.train", "train a model from a config file or flags, on this machine or under torchrun"),
    "convert": ("tessera.cli.convert", "convert Hugging Face checkpoints to and from Tessera"),
    "export": ("tessera.cli.export", "write a training checkpoint as a Hugging Face model directory"),
    "profile": ("tessera.cli.profile", "measure the hardware or a model and write a profile JSON"),
    "validate": ("tessera.cli.validate", "run a plan for a few steps: predicted vs measured"),
    "diagnose": ("tessera.cli.diagnose", "a run's per-rank timeline and its slowest rank, with the evidence"),
    "dryrun": ("tessera.cli.dryrun", "run a plan's first and last ranks at its real world size on a fake "
                                     "process group: states and collectives, predicted vs measured"),
}


def _available_verbs() -> dict[str, tuple[str, str]]:
    from importlib.util import find_spec

    return {verb: spec for verb, spec in VERBS.items() if find_spec(spec[0]) is not None}


DESCRIPTION = """\
Tessera trains large Transformer models on many GPUs without you choosing how to split them. It
finds the fastest combination of data, tensor, pipeline and sequence parallelism, ZeRO sharding and
activation recompute that fits in memory, predicts its step time and memory, and trains with
exactly that plan on PyTorch (torchrun, FSDP2, DTensor, pipelining)."""

EPILOG = """\
getting started:
  tessera plan                                   plan LLaMA-2 7B on 64 H100s (no GPU needed)
  tessera plan --model llama3-70b --gpus 1024 --global-batch 1024 --seq-len 8192 -o plan.json
  tessera show plan.json                         the plan as tables, its pipeline timeline and memory
  tessera train --model tiny-llama --nproc 2     train on this CPU with 2 ranks
  tessera train --config examples/demo.toml      the same from a config file

`tessera VERB --help` lists a verb's options with their defaults."""


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="tessera", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tessera {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (module, help_text) in _available_verbs().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if verb is None or verb == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..errors import TesseraError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["plan"]  # the built-in default job
    verb = argv[0] if argv and not argv[0].startswith("-") else None
    args = build_parser(verb).parse_args(argv)
    if args.verb is None:
        build_parser().print_help()
        return 0
    from ..runtime.affinity import pin_cpu_rank
    from ..runtime.host_malloc import steady_host_allocator

    try:
        pin_cpu_rank()  # before any thread starts, so that they all inherit it
        steady_host_allocator()  # before anything is allocated: one malloc regime for the whole run
        module = importlib.import_module(_available_verbs()[args.verb][0])
        return int(module.run(args) or 0)
    except (TesseraError, ValueError, FileNotFoundError) as e:
        if os.environ.get("TESSERA_DEBUG"):
            raise
        print(f"tessera {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tessera {args.verb}: interrupted", file=sys.stderr)
        return 130
