"""`tessera convert hf-to-tessera HF_DIR OUT_DIR` and `tessera convert tessera-to-hf IN_DIR OUT_HF_DIR`.

A Tessera checkpoint is `config.json` (TransformerConfig) + `model.safetensors`; the HF side is what
`transformers` `save_pretrained` writes and `from_pretrained` reads (LLaMA, Qwen2, Mistral, Mixtral,
GPT-2). The output directory appears all at once or not at all.
"""
from __future__ import annotations

import argparse

DIRECTIONS = ("hf-to-tessera", "tessera-to-hf")
DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("direction", choices=DIRECTIONS, help="which way to convert")
    parser.add_argument("src", help="checkpoint directory to read")
    parser.add_argument("dst", help="checkpoint directory to write")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="cast floating-point weights (default: keep the source dtype)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from ..models import hf

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.direction == "hf-to-tessera":
        cfg, sd = hf.load_hf_checkpoint(args.src)
        out = hf.save_tessera_checkpoint(cfg, sd, args.dst, dtype=dtype, overwrite=args.overwrite)
    else:
        cfg, sd = hf.load_tessera_checkpoint(args.src)
        out = hf.save_hf_checkpoint(cfg, sd, args.dst, dtype=dtype, overwrite=args.overwrite)
    params = sum(t.numel() for t in sd.values())
    Console().print(f"[green]converted[/] {cfg.name} ({cfg.family}, {params / 1e6:.2f}M parameters, "
                    f"{len(sd)} tensors) -> {out}")
    return 0
