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
    "plan": ("tessera.cli.plan", "search the fastest hybrid-parallel plan that fits memory"),
    "show": ("tessera.cli.show", "show a plan as tables and a picture"),
    "train": ("tessera.cli.train", "train a model with a plan (launches torchrun for --nproc)"),
    "convert": ("tessera.cli.convert", "convert Hugging Face checkpoints to and from Tessera"),
    "export": ("tessera.cli.export", "write a training checkpoint as a Hugging Face model directory"),
    "profile": ("tessera.cli.profile", "measure the hardware or a model and write a profile JSON"),
    "validate": ("tessera.cli.validate", "run a plan for a few steps: predicted vs measured"),
    "diagnose": ("tessera.cli.diagnose", "a run's per-rank timeline and its slowest rank, with the evidence"),
}


def _available_verbs() -> dict[str, tuple[str, str]]:
    from importlib.util import find_spec

    return {verb: spec for verb, spec in VERBS.items() if find_spec(spec[0]) is not None}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__.splitlines()[0])
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

    try:
        pin_cpu_rank()  # before any thread starts, so that they all inherit it
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
