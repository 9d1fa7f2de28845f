"""Hugging Face `config.json` of a vision-language model -> `VLMConfig`, without torch or transformers.

Two families, keys as `transformers` writes them:
  - "llava" (`LlavaConfig`): `vision_config` (a `clip_vision_model` or `siglip_vision_model`),
    `text_config` (any decoder `hf_config` reads), `projector_hidden_act`, `vision_feature_layer`,
    `vision_feature_select_strategy`, `multimodal_projector_bias`, `image_token_index` (the image
    placeholder id; `image_token_id` in newer files). Released files leave out the
    fields equal to the config classes' defaults (llava-1.5-7b-hf's `text_config` names only
    `vocab_size` and a few others), so those defaults are filled in here: LlamaConfig's for the text
    model, CLIPVisionConfig's / SiglipVisionConfig's for the encoder.
  - "qwen2_vl" (`Qwen2VLConfig`): the LLM's fields at the top level (transformers < 4.52) or under
    `text_config`; `vision_config` with `depth`, `embed_dim`, `mlp_ratio`, `num_heads`, `in_chans`,
    `patch_size`, `spatial_merge_size`, `temporal_patch_size`; `image_token_id` at the top level. Qwen2-VL takes images at any
    resolution; the planner prices a fixed `image_size` (default 448 px).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import TesseraError
from .hf_config import CONFIG_FILE, hf_dict_to_config, read_hf_config_dict
from .multimodal import ProjectorConfig, VisionEncoderConfig, VLMConfig

VLM_MODEL_TYPES = ("llava", "qwen2_vl")
QWEN2_VL_IMAGE_SIZE = 448

# transformers' LlamaConfig defaults (what llava's partial text_config relies on).
_LLAMA_DEFAULTS = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048)
_VISION_DEFAULTS = {
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu",
                              layer_norm_eps=1e-5),
    "siglip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                                hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
}
_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def is_vlm_config_file(path: str | Path) -> bool:
    """Whether `path` is (or is a directory holding) a config.json of a supported VLM family."""
    p = Path(str(path)).expanduser()
    if p.is_dir():
        p = p / CONFIG_FILE
    if not p.is_file():
        return False
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get("model_type") in VLM_MODEL_TYPES


def load_hf_vlm_config(path: str | Path, name: str | None = None,
                       image_size: int | None = None) -> VLMConfig:
    p = Path(str(path)).expanduser()
    file = p / CONFIG_FILE if p.is_dir() else p
    return hf_dict_to_vlm_config(read_hf_config_dict(file), name=name or file.parent.name or file.stem,
                                 source=str(file), image_size=image_size)


def _act(value: str, field: str, source: str) -> str:
    if value not in _ACTS:
        raise TesseraError(f"{source}: {field} '{value}' is not supported (supported: {', '.join(_ACTS)})")
    return _ACTS[value]


def _section(d: dict, key: str, source: str) -> dict:
    section = d.get(key)
    if not isinstance(section, dict):
        raise TesseraError(f"{source}: missing required field '{key}' (an object)")
    return section


def hf_dict_to_vlm_config(d: dict[str, Any], name: str = "hf-vlm", source: str = "config.json",
                          image_size: int | None = None) -> VLMConfig:
    model_type = d.get("model_type")
    if model_type not in VLM_MODEL_TYPES:
        raise TesseraError(f"{source}: model_type '{model_type}' is not a supported vision-language model "
                           f"(supported: {', '.join(VLM_MODEL_TYPES)})")
    try:
        if model_type == "llava":
            return _llava(d, name, source)
        return _qwen2_vl(d, name, source, image_size or QWEN2_VL_IMAGE_SIZE)
    except ValidationError as e:
        err = e.errors()[0]
        raise TesseraError(f"{source}: invalid model config ({'.'.join(map(str, err['loc']))}: {err['msg']})") from None


def _llava(d: dict, name: str, source: str) -> VLMConfig:
    vd = _section(d, "vision_config", source)
    vtype = vd.get("model_type", "clip_vision_model")
    if vtype not in _VISION_DEFAULTS:
        raise TesseraError(f"{source}: vision_config.model_type '{vtype}' is not supported "
                           f"(supported: {', '.join(_VISION_DEFAULTS)})")
    v = {**_VISION_DEFAULTS[vtype], **vd}
    clip = vtype == "clip_vision_model"
    vision = VisionEncoderConfig(
        name=f"{name}-vision", family="clip" if clip else "siglip", image_size=int(v["image_size"]),
        patch_size=int(v["patch_size"]), channels=int(v["num_channels"]), hidden=int(v["hidden_size"]),
        num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
        ffn_hidden=int(v["intermediate_size"]), norm="layernorm", norm_eps=float(v["layer_norm_eps"]),
        act=_act(v["hidden_act"], "vision_config.hidden_act", source), position="learned", class_token=clip)
    text = {**_LLAMA_DEFAULTS, **(d.get("text_config") or {})}
    llm = hf_dict_to_config(text, name=f"{name}-llm", source=f"{source} text_config")
    layer = d.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise TesseraError(f"{source}: vision_feature_layer={layer!r} (several layers concatenated) is not supported")
    select = d.get("vision_feature_select_strategy", "default")
    if select not in ("default", "full"):
        raise TesseraError(f"{source}: vision_feature_select_strategy '{select}' is not 'default' or 'full'")
    projector = ProjectorConfig(merge=1, layers=2, act=_act(d.get("projector_hidden_act", "gelu"),
                                                          "projector_hidden_act", source),
                                bias=bool(d.get("multimodal_projector_bias", True)))
    return VLMConfig(name=name, family="llava", vision=vision, projector=projector, llm=llm,
                     feature_layer=layer, feature_select=select,
                     image_token_id=_token_id(d, ("image_token_index", "image_token_id"), llm.vocab_size, source))


def _qwen2_vl(d: dict, name: str, source: str, image_size: int) -> VLMConfig:
    vd = _section(d, "vision_config", source)
    for key in ("depth", "embed_dim", "num_heads", "patch_size"):
        if vd.get(key) is None:
            raise TesseraError(f"{source}: missing required field 'vision_config.{key}'")
    embed, merge = int(vd["embed_dim"]), int(vd.get("spatial_merge_size", 2))
    vision = VisionEncoderConfig(
        name=f"{name}-vision", family="qwen2_vl", image_size=image_size, patch_size=int(vd["patch_size"]),
        channels=int(vd.get("in_chans", vd.get("in_channels", 3))),
        temporal_patch_size=int(vd.get("temporal_patch_size", 2)), hidden=embed, num_layers=int(vd["depth"]),
        num_heads=int(vd["num_heads"]), ffn_hidden=int(embed * float(vd.get("mlp_ratio", 4))), norm="layernorm",
        norm_eps=1e-6, act=_act(vd.get("hidden_act", "quick_gelu"), "vision_config.hidden_act", source),
        position="rope2d", class_token=False)
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else None
    text = dict(text) if text and text.get("hidden_size") else {k: v for k, v in d.items() if k != "vision_config"}
    text["model_type"] = "qwen2"
    # M-RoPE (rope_scaling type "mrope") splits the rotary dimensions over time/height/width
    # positions: the same FLOPs as 1-D RoPE, so planning ignores it.
    text.pop("rope_scaling", None)
    text.pop("rope_parameters", None) if (text.get("rope_parameters") or {}).get("rope_type") == "mrope" else None
    llm = hf_dict_to_config(text, name=f"{name}-llm", source=f"{source} (text model)")
    projector = ProjectorConfig(merge=merge, norm=True, layers=2, hidden=embed * merge ** 2, act="gelu")
    return VLMConfig(name=name, family="qwen2_vl", vision=vision, projector=projector, llm=llm,
                     image_token_id=_token_id(d, ("image_token_id",), llm.vocab_size, source))


def _token_id(d: dict, keys: tuple[str, ...], vocab_size: int, source: str) -> int | None:
    """The image placeholder id under the first of `keys` present (None: the runtime's default)."""
    for key in keys:
        value = d.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            raise TesseraError(f"{source}: {key}={value!r} is not a token id of the LLM's vocabulary of {vocab_size}")
        return value
    return None
