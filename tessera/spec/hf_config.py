"""Hugging Face `config.json` <-> `TransformerConfig`, without torch or transformers.

`tessera plan --model path/to/config.json` plans for a model it has never seen: the config file of
a LLaMA, Qwen2, Mistral, Mixtral, Qwen2-MoE or GPT-2 checkpoint is enough. Field names follow the released
`config.json` files; a field the file leaves out takes the default of the matching `transformers`
config class (e.g. `rms_norm_eps`), but the fields that fix the shape are required.

Both RoPE layouts in the wild are read: `rope_theta` at the top level (transformers < 5) and
`rope_parameters.rope_theta` (transformers >= 5). Scaled RoPE (`rope_type` other than "default"),
sliding-window attention and other features the Tessera model does not run are accepted for
planning (they do not change the cost) and logged; `unsupported_features` names them so that a
checkpoint converter can refuse them.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import TesseraError
from .model import TransformerConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"

# model_type -> HF architecture class name (what `from_pretrained` instantiates).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)

# Defaults of the transformers config classes for the optional fields.
_LLAMA_LIKE_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0),
    "qwen2": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0),
    "mistral": dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, rope_theta=10000.0),
    "mixtral": dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, rope_theta=1e6),
    "qwen2_moe": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0),
}
_ROUTER_AUX_LOSS_COEF = 0.001  # MixtralConfig / Qwen2MoeConfig default
_LLAMA_LIKE_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads")
_GPT2_REQUIRED = ("vocab_size", "n_embd", "n_layer", "n_head")
# Activation names that are the tanh approximation of GELU (what the Tessera MLP computes).
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _config_file(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / CONFIG_FILE
    if not p.is_file():
        raise TesseraError(f"no Hugging Face config found at '{p}'")
    return p


def read_hf_config_dict(path: str | Path) -> dict[str, Any]:
    """The raw `config.json` as a dict (path = the file or the directory holding it)."""
    file = _config_file(path)
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TesseraError(f"'{file}' is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TesseraError(f"'{file}' does not hold a JSON object")
    return data


def load_hf_config(path: str | Path, name: str | None = None) -> TransformerConfig:
    """Read a Hugging Face `config.json` (or a directory holding one) into a `TransformerConfig`."""
    file = _config_file(path)
    default_name = file.parent.name or file.stem
    return hf_dict_to_config(read_hf_config_dict(file), name=name or default_name, source=str(file))


# A field larger than this is not a model anyone trains (and would make the planner enumerate for ever).
_MAX_SIZE = 1 << 31


def _int(d: dict[str, Any], key: str, source: str, default: int | None = None, limit: int = _MAX_SIZE) -> int:
    """A positive integer field (JSON 12 or 12.0; not true, "12" or 12.5), at most `limit`."""
    value = d.get(key)
    if value is None:
        if default is None:
            raise TesseraError(f"{source}: missing required field '{key}'")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value):
        raise TesseraError(f"{source}: {key} must be a whole number, got {value!r}")
    if not 0 < value <= limit:
        raise TesseraError(f"{source}: {key} must be between 1 and {limit:,}, got {value!r}")
    return int(value)


def _bool(d: dict[str, Any], key: str, default: bool, source: str) -> bool:
    """A JSON true/false field: a string such as "no" is refused, not read as true."""
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TesseraError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def _rope_theta(d: dict[str, Any], default: float) -> float:
    params = d.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(d.get("rope_theta", default))


def unsupported_features(d: dict[str, Any]) -> list[str]:
    """Features of an HF config that the Tessera model does not compute (numerics would differ)."""
    found = []
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    rope_type = (params.get("rope_type") if isinstance(params, dict) else None) or \
        (scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else None)
    if rope_type not in (None, "default"):
        found.append(f"rope_type={rope_type!r}")
    window = d.get("sliding_window")
    uses_window = d.get("use_sliding_window", d.get("model_type") in ("mistral", "mixtral"))
    if window and uses_window and window < d.get("max_position_embeddings", window + 1):
        found.append(f"sliding_window={window}")
    if d.get("model_type") == "gpt2":
        if d.get("scale_attn_by_inverse_layer_idx"):
            found.append("scale_attn_by_inverse_layer_idx")
        if d.get("scale_attn_weights") is False:
            found.append("scale_attn_weights=false")
    return found


def hf_dict_to_config(d: dict[str, Any], name: str = "hf-model", source: str = "config.json") -> TransformerConfig:
    """Map the fields of an HF config dict onto `TransformerConfig` (see the module docstring)."""
    model_type = d.get("model_type")
    if model_type is None:
        raise TesseraError(f"{source}: missing required field 'model_type' "
                           f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise TesseraError(f"{source}: unsupported model_type '{model_type}'; "
                           f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    required = _GPT2_REQUIRED if model_type == "gpt2" else _LLAMA_LIKE_REQUIRED
    for key in required:
        if d.get(key) is None:
            raise TesseraError(f"{source}: missing required field '{key}' for model_type '{model_type}'")
    for feature in unsupported_features(d):
        log.warning("%s: %s is not computed by the Tessera model (planning is unaffected)", source, feature)
    try:
        fields = _gpt2_fields(d, source) if model_type == "gpt2" else _llama_like_fields(d, model_type, source)
    except (TypeError, ValueError) as e:  # e.g. a number field holding a list
        raise TesseraError(f"{source}: a field has the wrong type ({str(e).splitlines()[0]})") from None
    try:
        return TransformerConfig(name=name, family=model_type, **fields)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise TesseraError(f"{source}: invalid model config ({problems})") from None


def _llama_like_fields(d: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    defaults = _LLAMA_LIKE_DEFAULTS[model_type]
    hidden, heads = _int(d, "hidden_size", source), _int(d, "num_attention_heads", source)
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise TesseraError(f"{source}: hidden_act '{act}' is not supported (Tessera's gated MLP uses 'silu')")
    head_dim = d.get("head_dim")
    if head_dim is not None and heads and int(head_dim) * heads != hidden:
        raise TesseraError(f"{source}: head_dim={head_dim} differs from hidden_size/num_attention_heads="
                           f"{hidden}/{heads}, which the Tessera model does not support")
    attention_bias, mlp_bias = _bool(d, "attention_bias", False, source), _bool(d, "mlp_bias", False, source)
    if attention_bias != mlp_bias:
        raise TesseraError(f"{source}: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not "
                           "supported (both or neither)")
    fields: dict[str, Any] = dict(
        vocab_size=_int(d, "vocab_size", source), hidden=hidden,
        num_layers=_int(d, "num_hidden_layers", source),
        num_heads=heads, num_kv_heads=_int(d, "num_key_value_heads", source, default=heads),
        ffn_hidden=_int(d, "intermediate_size", source),
        max_seq_len=_int(d, "max_position_embeddings", source, default=defaults["max_position_embeddings"]),
        norm="rmsnorm", norm_eps=float(d.get("rms_norm_eps", defaults["rms_norm_eps"])), mlp="swiglu",
        position="rope", rope_theta=_rope_theta(d, defaults["rope_theta"]),
        # Qwen2 always has biases on q, k, v (and on nothing else).
        qkv_bias=model_type in ("qwen2", "qwen2_moe") or attention_bias, linear_bias=attention_bias and mlp_bias,
        tie_embeddings=_bool(d, "tie_word_embeddings", False, source),
    )
    if model_type == "mixtral":
        fields.update(num_experts=_int(d, "num_local_experts", source, default=8),
                      top_k=_int(d, "num_experts_per_tok", source, default=2),
                      router_aux_loss_coef=float(d.get("router_aux_loss_coef", _ROUTER_AUX_LOSS_COEF)))
    if model_type == "qwen2_moe":
        fields.update(_qwen2_moe_fields(d, source))
    if model_type in ("mixtral", "qwen2_moe"):
        fields.update(_routing_options(d))
    return fields


def _routing_options(d: dict[str, Any]) -> dict[str, Any]:
    """Training options of the routing that Tessera reads when a config names them (HF's Mixtral
    and Qwen2-MoE have neither): `capacity_factor` (absent or null: dropless) and
    `router_z_loss_coef` (the ST-MoE z-loss, as Switch Transformers' configs name it)."""
    out: dict[str, Any] = {}
    if d.get("capacity_factor") is not None:
        out["capacity_factor"] = float(d["capacity_factor"])
    if d.get("router_z_loss_coef") is not None:
        out["router_z_loss_coef"] = float(d["router_z_loss_coef"])
    return out


def _qwen2_moe_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    """Experts in every layer (Tessera's MoE blocks share one expert size), a shared expert."""
    step, dense = int(d.get("decoder_sparse_step", 1)), d.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise TesseraError(f"{source}: decoder_sparse_step={step} / mlp_only_layers={dense} (dense layers among "
                           "the MoE layers) is not supported: Tessera's Qwen2-MoE has experts in every layer")
    return dict(num_experts=_int(d, "num_experts", source, default=60),
                top_k=_int(d, "num_experts_per_tok", source, default=4),
                ffn_hidden=_int(d, "moe_intermediate_size", source, default=1408), router="softmax_topk",
                norm_topk_prob=_bool(d, "norm_topk_prob", False, source),
                shared_expert_ffn=_int(d, "shared_expert_intermediate_size", source, default=5632),
                router_aux_loss_coef=float(d.get("router_aux_loss_coef", _ROUTER_AUX_LOSS_COEF)))


def _gpt2_fields(d: dict[str, Any], source: str) -> dict[str, Any]:
    act = d.get("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        raise TesseraError(f"{source}: activation_function '{act}' is not supported "
                           f"(the Tessera GPT-2 MLP computes {'/'.join(_TANH_GELU)})")
    hidden = _int(d, "n_embd", source)
    return dict(
        vocab_size=_int(d, "vocab_size", source), hidden=hidden,
        num_layers=_int(d, "n_layer", source),
        num_heads=_int(d, "n_head", source), num_kv_heads=_int(d, "n_head", source),
        ffn_hidden=_int(d, "n_inner", source, default=4 * hidden),
        max_seq_len=_int(d, "n_positions", source, default=1024),
        norm="layernorm", norm_eps=float(d.get("layer_norm_epsilon", 1e-5)), mlp="gelu",
        position="learned", linear_bias=True, tie_embeddings=_bool(d, "tie_word_embeddings", True, source),
    )


def resolve_model_config(name_or_path: str | Path) -> TransformerConfig:
    """A preset name (`tessera.spec.presets`) or the path of an HF `config.json` / its directory."""
    from .presets.models import MODEL_CONFIGS, get_model_config

    text = str(name_or_path)
    if text in MODEL_CONFIGS:
        return MODEL_CONFIGS[text]
    path = Path(text).expanduser()
    if path.exists():
        return load_hf_config(path)
    if text.endswith(".json") or "/" in text or "\\" in text:
        raise TesseraError(f"no model preset or Hugging Face config at '{text}'")
    return get_model_config(text)  # raises, listing the known presets


def to_hf_config(cfg: TransformerConfig) -> dict[str, Any]:
    """The HF `config.json` dict for `cfg`, loadable by `transformers.AutoConfig` / `from_pretrained`.

    Raises TesseraError when the HF architecture of `cfg.family` cannot express `cfg`.
    """
    def refuse(why: str) -> TesseraError:
        return TesseraError(f"model '{cfg.name}' cannot be exported as a {ARCHITECTURES[cfg.family]}: {why}")

    base: dict[str, Any] = dict(architectures=[ARCHITECTURES[cfg.family]], model_type=cfg.family,
                                vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings,
                                torch_dtype="float32", dtype="float32")
    if cfg.family == "gpt2":
        if (cfg.norm, cfg.mlp, cfg.position, cfg.linear_bias) != ("layernorm", "gelu", "learned", True):
            raise refuse("GPT-2 needs layernorm, gelu MLP, learned positions and linear biases")
        if cfg.num_kv_heads != cfg.num_heads or cfg.num_experts:
            raise refuse("GPT-2 has neither grouped-query attention nor experts")
        return base | dict(n_embd=cfg.hidden, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                           n_inner=cfg.ffn_hidden, n_positions=cfg.max_seq_len,
                           layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new",
                           bos_token_id=50256, eos_token_id=50256)
    if (cfg.norm, cfg.mlp, cfg.position) != ("rmsnorm", "swiglu", "rope"):
        raise refuse("it needs rmsnorm, a swiglu MLP and rope positions")
    if cfg.family in ("qwen2", "qwen2_moe") and (not cfg.qkv_bias or cfg.linear_bias):
        raise refuse("Qwen2 has biases on q, k, v and nowhere else")
    if cfg.family in ("mistral", "mixtral") and (cfg.qkv_bias or cfg.linear_bias):
        raise refuse("it has no linear biases")
    if cfg.family == "llama" and cfg.qkv_bias != cfg.linear_bias:
        raise refuse("LLaMA has biases on all linear layers or on none")
    if (cfg.family in ("mixtral", "qwen2_moe")) != bool(cfg.num_experts):
        raise refuse("experts need the mixtral or qwen2_moe family, and those need experts")
    if cfg.num_experts and cfg.moe_every != 1:
        raise refuse("it has experts in every layer (moe_every=1)")
    if cfg.family == "mixtral" and (cfg.router != "topk_softmax" or cfg.shared_expert_ffn):
        raise refuse("Mixtral routes with a softmax over the top-k logits and has no shared expert")
    if cfg.family == "qwen2_moe" and (cfg.router != "softmax_topk" or not cfg.shared_expert_ffn):
        raise refuse("Qwen2-MoE routes with a softmax over all experts and has a shared expert")
    out = base | dict(
        hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
        rope_theta=cfg.rope_theta, rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
    )
    if cfg.family == "llama":
        out.update(attention_bias=cfg.linear_bias, mlp_bias=cfg.linear_bias)
    if cfg.family in ("qwen2", "mistral", "mixtral", "qwen2_moe"):
        out.update(sliding_window=None, use_sliding_window=False)
    # Dropless routing and the z-loss are training settings Tessera adds; HF's models have neither.
    if cfg.family == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    if cfg.family == "qwen2_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.ffn_hidden,
                   shared_expert_intermediate_size=cfg.shared_expert_ffn, norm_topk_prob=cfg.norm_topk_prob,
                   router_aux_loss_coef=cfg.router_aux_loss_coef, decoder_sparse_step=1, mlp_only_layers=[])
    return out
