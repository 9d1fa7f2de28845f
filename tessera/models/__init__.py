"""Torch modules the runtime trains (single-device code; parallelism is applied from outside)."""
from .transformer import Transformer, build_model

__all__ = ["Transformer", "build_model"]
