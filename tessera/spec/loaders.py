"""Turn what a user types into specs: a model name or config path, a cluster JSON file.

`resolve_model("llama3-70b")` gives a preset; `resolve_model("path/to/config.json")` (or the
directory holding it) reads a Hugging Face config. `load_cluster("cluster.json")` reads a
`ClusterSpec` written by `tessera profile hardware` or by hand. Every failure is one
`TesseraError` sentence that names the file and the offending field. No torch import.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from ..errors import TesseraError
from .jsonio import first_validation_error, read_json_object
from .cluster import ClusterSpec
from .model import ModelSpec
from .presets.models import MODEL_CONFIGS, get_model


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or a model built from a Hugging Face `config.json` (file or its directory)."""
    if name_or_path in MODEL_CONFIGS:
        return get_model(name_or_path)
    # Imported here so that preset planning never depends on the config reader.
    from .hf_config import resolve_model_config

    return ModelSpec.from_config(resolve_model_config(name_or_path))


def load_cluster(path: str | Path) -> ClusterSpec:
    """A `ClusterSpec` from its JSON file, validated; errors name the file and the field."""
    data = read_json_object(path, "cluster file")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise TesseraError(f"invalid cluster file {path}: {first_validation_error(e)}") from None
