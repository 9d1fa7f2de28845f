"""Reading user-supplied JSON files with one-line errors (torch-free)."""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from ..errors import TesseraError


def read_json_object(path: str | Path, what: str) -> dict:
    """The JSON object in `path`; `what` names the file in errors ("cluster file", "model profile")."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TesseraError(f"{what} {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TesseraError(f"{what} {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TesseraError(f"{what} {path} must hold a JSON object, not {type(data).__name__}")
    return data


def first_validation_error(e: ValidationError) -> str:
    """'device.memory_bytes: Input should be greater than 0' (plus how many more errors)."""
    errors = e.errors()
    err = errors[0]
    where = ".".join(str(p) for p in err["loc"])
    text = f"{where}: {err['msg']}" if where else err["msg"]
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text
