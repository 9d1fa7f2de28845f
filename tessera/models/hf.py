"""Hugging Face checkpoints <-> Tessera `Transformer` state dicts, and both checkpoint formats on disk.

Name mapping (HF -> Tessera), per block i:

  LLaMA / Qwen2 / Mistral / Mixtral (`model.` prefix)    GPT-2 (`transformer.` prefix, optional)
  embed_tokens -> tok_embeddings                         wte -> tok_embeddings, wpe -> pos_embeddings
  layers.i.input_layernorm -> attention_norm             h.i.ln_1 -> attention_norm
  self_attn.{q,k,v,o}_proj -> attention.{wq,wk,wv,wo}    attn.c_attn -> wq|wk|wv (split in 3), attn.c_proj -> wo
  post_attention_layernorm -> ffn_norm                   h.i.ln_2 -> ffn_norm
  mlp.{gate,up,down}_proj -> feed_forward.{w1,w3,w2}     mlp.c_fc -> w1, mlp.c_proj -> w2
  block_sparse_moe.gate -> moe.gate                      ln_f -> norm
  block_sparse_moe.experts.e.w{1,2,3} -> moe.experts.e.w{1,2,3}
  Qwen2-MoE: mlp.gate -> moe.gate, mlp.experts.e.{gate,up,down}_proj -> moe.experts.e.{w1,w3,w2},
  mlp.shared_expert.{gate,up,down}_proj -> moe.shared_expert.{w1,w3,w2}, mlp.shared_expert_gate -> same
  norm -> norm, lm_head -> output (absent when tied)

GPT-2's Conv1D stores weights as (in, out), so they are transposed. q and k need no permutation:
Tessera's RoPE rotates the first half of a head against the second half, HF's `rotate_half` layout
(checkpoints converted from Meta's interleaved layout are already permuted on the hub).
The fused MoE layout of transformers >= 5 in memory (`mlp.experts.gate_up_proj` (E, 2F, H),
`mlp.experts.down_proj` (E, H, F)) is read too; export writes the per-expert layout of the hub files,
which every transformers version loads.

A Tessera checkpoint directory holds `config.json` (the `TransformerConfig` as JSON) and
`model.safetensors` (Tessera names; a tied `output.weight` is not stored).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from pydantic import ValidationError

from ..errors import TesseraError
from ..spec.hf_config import hf_dict_to_config, read_hf_config_dict, to_hf_config, unsupported_features
from ..spec.model import TransformerConfig
from .transformer import Transformer

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
StateDict = dict[str, torch.Tensor]

# Buffers some HF checkpoints carry that are not weights.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")
_LLAMA_BLOCK = {
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
    "block_sparse_moe.gate": "moe.gate", "mlp.gate": "moe.gate",
    "mlp.shared_expert.gate_proj": "moe.shared_expert.w1", "mlp.shared_expert.up_proj": "moe.shared_expert.w3",
    "mlp.shared_expert.down_proj": "moe.shared_expert.w2", "mlp.shared_expert_gate": "moe.shared_expert_gate",
}
_QWEN_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_GPT2_BLOCK = {"ln_1": "attention_norm", "ln_2": "ffn_norm", "attn.c_proj": "attention.wo",
               "mlp.c_fc": "feed_forward.w1", "mlp.c_proj": "feed_forward.w2"}
_GPT2_TOP = {"wte": "tok_embeddings", "wpe": "pos_embeddings", "ln_f": "norm"}


# ----------------------------------------------------------------------------- state-dict mapping

def hf_to_tessera_state_dict(hf: StateDict, cfg: TransformerConfig) -> StateDict:
    """Rename (and for GPT-2 transpose/split) an HF state dict into Tessera names.

    Raises TesseraError listing HF keys that have no Tessera counterpart.
    """
    out: StateDict = {}
    unknown: list[str] = []
    for key, tensor in hf.items():
        if _IGNORED.search(key):
            continue
        mapped = _gpt2_key_to_tessera(key, tensor, cfg, out) if cfg.family == "gpt2" \
            else _llama_key_to_tessera(key, tensor, cfg, out)
        if not mapped:
            unknown.append(key)
    if unknown:
        raise TesseraError(f"{len(unknown)} checkpoint tensor(s) have no place in a {cfg.family} model, "
                           f"e.g. {', '.join(sorted(unknown)[:4])}")
    if cfg.tie_embeddings:
        out.pop("output.weight", None)
    return out


def _llama_key_to_tessera(key: str, t: torch.Tensor, cfg: TransformerConfig, out: StateDict) -> bool:
    key = key.removeprefix("model.")
    if key == "embed_tokens.weight":
        out["tok_embeddings.weight"] = t
    elif key == "norm.weight":
        out["norm.weight"] = t
    elif key == "lm_head.weight":
        out["output.weight"] = t
    else:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", key) or \
            re.fullmatch(r"layers\.(\d+)\.(mlp\.experts\.(?:gate_up_proj|down_proj))()", key)
        if not m:
            return False
        layer, module, param = m.groups()
        prefix = f"layers.{layer}."
        expert = re.fullmatch(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)",
                              module)
        if expert:
            out[f"{prefix}moe.experts.{expert[1]}.{_QWEN_EXPERT.get(expert[2], expert[2])}.{param}"] = t
        elif module == "mlp.experts.gate_up_proj":  # fused (E, 2F, H): gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}moe.experts.{e}.w1.weight"] = gate[e]
                out[f"{prefix}moe.experts.{e}.w3.weight"] = up[e]
        elif module == "mlp.experts.down_proj":  # fused (E, H, F)
            for e in range(t.shape[0]):
                out[f"{prefix}moe.experts.{e}.w2.weight"] = t[e]
        elif module in _LLAMA_BLOCK:
            out[f"{prefix}{_LLAMA_BLOCK[module]}.{param}"] = t
        else:
            return False
    return True


def _gpt2_key_to_tessera(key: str, t: torch.Tensor, cfg: TransformerConfig, out: StateDict) -> bool:
    key = key.removeprefix("transformer.")
    if key == "lm_head.weight":
        out["output.weight"] = t
        return True
    top = re.fullmatch(r"(wte|wpe|ln_f)\.(weight|bias)", key)
    if top:
        out[f"{_GPT2_TOP[top[1]]}.{top[2]}"] = t
        return True
    m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", key)
    if not m:
        return False
    layer, module, param = m.groups()
    prefix = f"layers.{layer}."
    # Conv1D weights are (in, out): Linear wants (out, in).
    value = t.t() if param == "weight" and not module.startswith("ln_") else t
    if module == "attn.c_attn":
        for name, part in zip(("wq", "wk", "wv"), value.chunk(3, dim=0)):
            out[f"{prefix}attention.{name}.{param}"] = part
    elif module in _GPT2_BLOCK:
        out[f"{prefix}{_GPT2_BLOCK[module]}.{param}"] = value
    else:
        return False
    return True


def tessera_to_hf_state_dict(sd: StateDict, cfg: TransformerConfig) -> StateDict:
    """Tessera names -> the HF names of the hub files (per-expert MoE layout, GPT-2 Conv1D)."""
    sd = {k: v for k, v in sd.items() if not (cfg.tie_embeddings and k == "output.weight")}
    return _tessera_to_gpt2(sd, cfg) if cfg.family == "gpt2" else _tessera_to_llama(sd, cfg)


def _tessera_to_llama(sd: StateDict, cfg: TransformerConfig) -> StateDict:
    qwen_moe = cfg.family == "qwen2_moe"
    block = {v: k for k, v in _LLAMA_BLOCK.items() if k != ("block_sparse_moe.gate" if qwen_moe else "mlp.gate")}
    qwen_expert = {v: k for k, v in _QWEN_EXPERT.items()}
    out: StateDict = {}
    for key, t in sd.items():
        if key == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif key == "norm.weight":
            out["model.norm.weight"] = t
        elif key == "output.weight":
            out["lm_head.weight"] = t
        else:
            m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", key)
            expert = m and re.fullmatch(r"moe\.experts\.(\d+)\.(w[123])", m[2])
            if expert and qwen_moe:
                out[f"model.layers.{m[1]}.mlp.experts.{expert[1]}.{qwen_expert[expert[2]]}.{m[3]}"] = t
            elif expert:
                out[f"model.layers.{m[1]}.block_sparse_moe.experts.{expert[1]}.{expert[2]}.{m[3]}"] = t
            elif m and m[2] in block:
                out[f"model.layers.{m[1]}.{block[m[2]]}.{m[3]}"] = t
            else:
                raise TesseraError(f"tensor '{key}' has no Hugging Face counterpart")
    return out


def _tessera_to_gpt2(sd: StateDict, cfg: TransformerConfig) -> StateDict:
    block = {v: k for k, v in _GPT2_BLOCK.items()}
    top = {v: k for k, v in _GPT2_TOP.items()}
    out: StateDict = {}
    for key, t in sd.items():
        name, _, param = key.rpartition(".")
        if name in top:
            out[f"transformer.{top[name]}.{param}"] = t
            continue
        if key == "output.weight":
            out["lm_head.weight"] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m and m[2] in ("attention.wq", "attention.wk", "attention.wv"):
            continue  # fused below
        if not (m and m[2] in block):
            raise TesseraError(f"tensor '{key}' has no Hugging Face counterpart")
        is_matrix = param == "weight" and not m[2].endswith("norm")
        out[f"transformer.h.{m[1]}.{block[m[2]]}.{param}"] = t.t() if is_matrix else t
    # Fuse q, k, v of the layers present (a streamed export converts a few layers at a time).
    for i in sorted({int(m[1]) for k in sd if (m := re.fullmatch(r"layers\.(\d+)\.attention\.wq\.weight", k))}):
        for param in ("weight", "bias"):
            parts = [sd[f"layers.{i}.attention.{w}.{param}"] for w in ("wq", "wk", "wv")]
            fused = torch.cat(parts, dim=0)
            out[f"transformer.h.{i}.attn.c_attn.{param}"] = fused.t() if param == "weight" else fused
    return out


# ----------------------------------------------------------------------------- files

def _read_safetensors(path: Path) -> StateDict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise TesseraError(f"cannot read '{path}': {e}") from None


def read_hf_weights(hf_dir: str | Path) -> StateDict:
    """All tensors of an HF checkpoint dir: model.safetensors, sharded safetensors, or pytorch_model.bin."""
    d = Path(hf_dir)
    if (d / WEIGHTS_FILE).is_file():
        return _read_safetensors(d / WEIGHTS_FILE)
    if (d / INDEX_FILE).is_file():
        shards = sorted(set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values()))
        out: StateDict = {}
        for shard in shards:
            out.update(_read_safetensors(d / shard))
        return out
    if (d / "pytorch_model.bin").is_file():
        return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise TesseraError(f"no weights in '{d}' (expected {WEIGHTS_FILE}, {INDEX_FILE} or pytorch_model.bin)")


def _check_dir(path: str | Path, what: str) -> Path:
    d = Path(path).expanduser()
    if not d.is_dir():
        raise TesseraError(f"{what} directory '{d}' does not exist")
    if not (d / CONFIG_FILE).is_file():
        raise TesseraError(f"{what} directory '{d}' has no {CONFIG_FILE}")
    return d


def load_hf_checkpoint(hf_dir: str | Path) -> tuple[TransformerConfig, StateDict]:
    """Read an HF checkpoint directory into (config, Tessera-named state dict)."""
    d = _check_dir(hf_dir, "Hugging Face checkpoint")
    raw = read_hf_config_dict(d)
    problems = unsupported_features(raw)
    if problems:
        raise TesseraError(f"{d / CONFIG_FILE}: {', '.join(problems)} is not computed by the Tessera model, "
                           "so the converted model would give other outputs")
    cfg = hf_dict_to_config(raw, name=d.name, source=str(d / CONFIG_FILE))
    sd = hf_to_tessera_state_dict(read_hf_weights(d), cfg)
    check_state_dict(cfg, sd)
    return cfg, sd


def _atomic_dir(out_dir: str | Path, files: dict[str, object], overwrite: bool) -> Path:
    """Write a checkpoint directory all at once: fill a temporary sibling, then rename it into place."""
    from safetensors.torch import save_file

    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise TesseraError(f"'{out}' already exists (choose another directory or allow overwriting)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, content in files.items():
            if isinstance(content, dict):
                tensors = {k: v.detach().contiguous().cpu() for k, v in content.items()}
                save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            else:
                (tmp / name).write_text(str(content))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _cast(sd: StateDict, dtype: torch.dtype | None) -> StateDict:
    return sd if dtype is None else {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def save_hf_checkpoint(cfg: TransformerConfig, sd: StateDict, out_dir: str | Path,
                       dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write an HF checkpoint dir (config.json + model.safetensors) that `from_pretrained` loads."""
    hf_cfg = to_hf_config(cfg)
    check_state_dict(cfg, sd)
    hf_sd = tessera_to_hf_state_dict(_cast(sd, dtype), cfg)
    if dtype is not None:
        hf_cfg["torch_dtype"] = hf_cfg["dtype"] = str(dtype).removeprefix("torch.")
    return _atomic_dir(out_dir, {CONFIG_FILE: json.dumps(hf_cfg, indent=2) + "\n", WEIGHTS_FILE: hf_sd},
                       overwrite)


def save_tessera_checkpoint(cfg: TransformerConfig, sd: StateDict, out_dir: str | Path,
                            dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write a Tessera checkpoint dir: config.json (TransformerConfig) + model.safetensors."""
    sd = {k: v for k, v in _cast(sd, dtype).items() if not (cfg.tie_embeddings and k == "output.weight")}
    check_state_dict(cfg, sd)
    return _atomic_dir(out_dir, {CONFIG_FILE: cfg.model_dump_json(indent=2) + "\n", WEIGHTS_FILE: sd},
                       overwrite)


def load_tessera_checkpoint(in_dir: str | Path) -> tuple[TransformerConfig, StateDict]:
    d = _check_dir(in_dir, "Tessera checkpoint")
    try:
        cfg = TransformerConfig.model_validate_json((d / CONFIG_FILE).read_text())
    except ValidationError as e:
        raise TesseraError(f"{d / CONFIG_FILE} is not a Tessera model config "
                           f"({e.errors()[0]['loc']}: {e.errors()[0]['msg']})") from None
    if not (d / WEIGHTS_FILE).is_file():
        raise TesseraError(f"Tessera checkpoint directory '{d}' has no {WEIGHTS_FILE}")
    sd = _read_safetensors(d / WEIGHTS_FILE)
    check_state_dict(cfg, sd)
    return cfg, sd


def is_hf_checkpoint(path: str | Path) -> bool:
    """An HF config names its `model_type`; a Tessera one does not."""
    return "model_type" in read_hf_config_dict(_check_dir(path, "checkpoint"))


def load_pretrained_state_dict(path: str | Path) -> tuple[TransformerConfig, StateDict]:
    """(config, Tessera-named state dict) from a Tessera or an HF checkpoint directory."""
    return load_hf_checkpoint(path) if is_hf_checkpoint(path) else load_tessera_checkpoint(path)


def check_state_dict(cfg: TransformerConfig, sd: StateDict) -> None:
    """Raise a one-line TesseraError unless `sd` has exactly the tensors (names, shapes) of `cfg`'s model."""
    with torch.device("meta"):
        own = Transformer(cfg).state_dict()
    expected = {k for k in own if not (cfg.tie_embeddings and k == "output.weight")}
    missing, extra = sorted(expected - sd.keys()), sorted(sd.keys() - expected - {"output.weight"})
    if missing or extra:
        raise TesseraError(f"checkpoint does not fit the model {cfg.name}: "
                           f"missing {missing[:4]}, unexpected {extra[:4]}")
    for k, t in sd.items():
        if own[k].shape != t.shape:
            raise TesseraError(f"checkpoint tensor '{k}' has shape {tuple(t.shape)}, "
                               f"the model {cfg.name} expects {tuple(own[k].shape)}")


def load_state_dict_strict(model: Transformer, sd: StateDict) -> None:
    """`load_state_dict` whose mismatch is a one-line TesseraError naming the tensors."""
    check_state_dict(model.config, sd)
    if model.config.tie_embeddings:  # the tied head is the embedding: never overwrite it
        sd = {k: v for k, v in sd.items() if k != "output.weight"}
    model.load_state_dict(sd, strict=False)


def load_pretrained(path: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """A `Transformer` with the weights of a Tessera or HF checkpoint directory (for `--init-from`)."""
    cfg, sd = load_pretrained_state_dict(path)
    with torch.device(device):
        model = Transformer(cfg)
    load_state_dict_strict(model, sd)
    return model


def model_state_dict(model: Transformer) -> StateDict:
    """The model's weights to save (tied output weight and non-persistent buffers left out)."""
    return {k: v for k, v in model.state_dict().items()
            if not (model.config.tie_embeddings and k == "output.weight")}
