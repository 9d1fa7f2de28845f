"""Turn what a user types into specs: a model name or config path, a cluster JSON file.

`resolve_model("llama3-70b")` gives a preset; `resolve_model("path/to/config.json")` (or the
directory holding it) reads a Hugging Face config. `load_cluster("cluster.json")` reads a
`ClusterSpec` written by `tessera profile hardware` or by hand. Every failure is one
`TesseraError` sentence that names the file and the offending field. No torch import.
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from ..errors import TesseraError
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
    path = Path(path).expanduser()
    if not path.is_file():
        raise TesseraError(f"cluster file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TesseraError(f"cluster file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TesseraError(f"cluster file {path} must hold a JSON object, not {type(data).__name__}")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise TesseraError(f"invalid cluster file {path}: {first_validation_error(e)}") from None


def first_validation_error(e: ValidationError) -> str:
    """'device.memory_bytes: Input should be greater than 0' (plus how many more errors)."""
    errors = e.errors()
    err = errors[0]
    where = ".".join(str(p) for p in err["loc"])
    text = f"{where}: {err['msg']}" if where else err["msg"]
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text
