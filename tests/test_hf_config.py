"""HF config.json -> TransformerConfig (torch-free planner input) and back."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tessera.errors import TesseraError
from tessera.spec.hf_config import load_hf_config, resolve_model_config, to_hf_config
from tessera.spec.model import ModelSpec
from tessera.spec.presets import MODEL_CONFIGS, UnknownModelError

# Released config.json files (abridged to the fields that matter), transformers 4.x style.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "vocab_size": 128256, "tie_word_embeddings": False, "hidden_act": "silu",
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "vocab_size": 152064, "sliding_window": 131072, "use_sliding_window": False,
    "tie_word_embeddings": False, "hidden_act": "silu",
}
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
    "rope_theta": 1e6, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02,
}
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "vocab_size": 151936, "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False,
}
GPT2 = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
    "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "layer_norm_epsilon": 1e-05, "vocab_size": 50257,
}
# transformers >= 5 writes the RoPE base under rope_parameters.
MISTRAL_V5 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "sliding_window": None,
    "vocab_size": 32768,
}


def _write(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("preset, data", [("llama3-8b", LLAMA3_8B), ("qwen2.5-7b", QWEN25_7B),
                                          ("mixtral-8x7b", MIXTRAL), ("qwen1.5-moe-a2.7b", QWEN15_MOE),
                                          ("gpt2", GPT2)])
def test_released_configs_equal_the_presets(tmp_path, preset, data):
    cfg = load_hf_config(_write(tmp_path, data))
    assert cfg.model_dump(exclude={"name"}) == MODEL_CONFIGS[preset].model_dump(exclude={"name"})
    assert ModelSpec.from_config(cfg).num_params == ModelSpec.from_config(MODEL_CONFIGS[preset]).num_params


def test_directory_v5_rope_parameters_and_name(tmp_path):
    (tmp_path / "mistral-small").mkdir()
    _write(tmp_path / "mistral-small", MISTRAL_V5)
    cfg = resolve_model_config(str(tmp_path / "mistral-small"))
    assert (cfg.name, cfg.family, cfg.rope_theta, cfg.num_kv_heads) == ("mistral-small", "mistral", 1e6, 8)


def test_transformers_reads_what_to_hf_config_writes(tmp_path):
    import transformers

    for preset in ("tiny-llama", "tiny-gpt2", "tiny-moe", "tiny-qwen-moe", "qwen2.5-7b", "llama2-70b"):
        cfg = MODEL_CONFIGS[preset]
        hf = to_hf_config(cfg)
        assert load_hf_config(_write(tmp_path, hf)).model_dump(exclude={"name"}) == cfg.model_dump(exclude={"name"})
        auto = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
        assert auto.num_hidden_layers == cfg.num_layers and auto.vocab_size == cfg.vocab_size


def test_missing_field_names_field_and_file(tmp_path):
    path = _write(tmp_path, {k: v for k, v in LLAMA3_8B.items() if k != "intermediate_size"})
    with pytest.raises(TesseraError, match=r"config\.json.*missing required field 'intermediate_size'"):
        load_hf_config(path)
    with pytest.raises(TesseraError, match="missing required field 'n_embd'"):
        load_hf_config(_write(tmp_path, {k: v for k, v in GPT2.items() if k != "n_embd"}))


def test_bad_input_is_one_sentence(tmp_path):
    with pytest.raises(TesseraError, match="unsupported model_type 'bert'.*llama, qwen2, mistral, mixtral, gpt2"):
        load_hf_config(_write(tmp_path, {"model_type": "bert", "hidden_size": 8}))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(TesseraError, match="not valid JSON"):
        load_hf_config(tmp_path / "broken.json")
    with pytest.raises(TesseraError, match="no Hugging Face config"):
        load_hf_config(tmp_path / "missing")
    with pytest.raises(TesseraError, match="num_attention_heads must be between 1 and"):
        load_hf_config(_write(tmp_path, {**LLAMA3_8B, "num_attention_heads": 0}))
    with pytest.raises(TesseraError, match="not divisible"):
        load_hf_config(_write(tmp_path, {**LLAMA3_8B, "num_key_value_heads": 5}))
    with pytest.raises(TesseraError, match="hidden_act 'gelu'"):
        load_hf_config(_write(tmp_path, {**LLAMA3_8B, "hidden_act": "gelu"}))
    with pytest.raises(TesseraError, match="no model preset or Hugging Face config"):
        resolve_model_config("does/not/exist.json")
    with pytest.raises(UnknownModelError, match="tiny-llama"):
        resolve_model_config("llama9")
    assert resolve_model_config("tiny-llama") is MODEL_CONFIGS["tiny-llama"]


def test_scaled_rope_and_sliding_window_plan_with_a_warning(tmp_path, caplog):
    data = {**LLAMA3_8B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with caplog.at_level("WARNING"):
        cfg = load_hf_config(_write(tmp_path, data))
    assert cfg.hidden == 4096 and "rope_type='llama3'" in caplog.text


def test_hf_config_is_torch_free():
    code = ("import sys, tessera.spec.hf_config as h; assert 'torch' not in sys.modules; "
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
