"""Tessera: automatic hybrid-parallel training for large Transformer models."""
__version__ = "0.1.0"
