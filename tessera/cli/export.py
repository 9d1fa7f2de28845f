"""`tessera export CKPT_DIR OUT_DIR`: a training checkpoint as a Hugging Face model directory.

CKPT_DIR is a checkpoint directory (its latest `step-N` is exported) or one `step-N` in it, written
at any world size under any plan. OUT_DIR gets `config.json`, sharded safetensors with
`model.safetensors.index.json`, and the tokenizer files, and loads with `from_pretrained`.
"""
from __future__ import annotations

import argparse

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", metavar="CKPT_DIR", help="checkpoint directory (latest step) or a step-N directory")
    parser.add_argument("out", metavar="OUT_DIR", help="Hugging Face directory to write")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="cast floating-point weights (default: as trained)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard (default 2GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..runtime.export import DTYPES as TORCH_DTYPES
    from ..runtime.export import export_checkpoint, parse_size

    out, config = export_checkpoint(args.ckpt, args.out, dtype=TORCH_DTYPES[args.dtype] if args.dtype else None,
                                    max_shard_bytes=parse_size(args.max_shard_size), overwrite=args.overwrite)
    files = sorted(p.name for p in out.iterdir())
    Console().print(f"[green]exported[/] {config.name} ({config.family}) -> {out} ({len(files)} files)")
    return 0
