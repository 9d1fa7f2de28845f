"""The VLM spec: presets' sizes against the published checkpoints, the HF config.json parser."""
import json

import pytest

from tessera.errors import TesseraError
from tessera.spec.hf_vlm import hf_dict_to_vlm_config, load_hf_vlm_config
from tessera.spec.model import LayerKind
from tessera.spec.multimodal import VLMSpec, is_vlm, resolve_vlm, resolve_vlm_config, vlm_names


def test_presets_match_published_sizes():
    llava = resolve_vlm("llava-1.5-7b")
    # CLIP ViT-L/14-336 has 303.5M parameters over 24 blocks; LLaVA runs 23 (feature layer -2).
    assert 285e6 < llava.encoder.num_params < 300e6
    assert llava.projector.params == 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert llava.image_tokens == 576 and llava.encoder_seq_len == 577
    qwen = resolve_vlm("qwen2-vl-7b")
    assert qwen.image_tokens == 256 and qwen.encoder_seq_len == 1024
    # Qwen2-VL-7B's ViT + merger: 675M.
    assert 660e6 < qwen.encoder.num_params + qwen.projector.params < 690e6
    kinds = [layer.kind for layer in qwen.layers]
    assert kinds[0] == LayerKind.EMBEDDING and kinds[1] == LayerKind.ENCODER
    assert kinds.index(LayerKind.PROJECTOR) == 33 and kinds[-1] == LayerKind.LM_HEAD
    # Bidirectional attention: twice a causal block's attention FLOPs coefficient per width.
    block = qwen.encoder.layers[1]
    assert block.attn_flops_coeff == 4.0 * 1280
    assert {"tiny-vlm", "vit6b-llama3-70b"} <= set(vlm_names())


def _tiny_llava():
    return {
        "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 256,
                          "num_hidden_layers": 3, "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
        "text_config": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000},
    }


def test_llava_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_llava()))
    assert is_vlm(str(tmp_path)) and not is_vlm(str(tmp_path / "nothing"))
    c = load_hf_vlm_config(tmp_path)
    assert (c.vision.hidden, c.vision.num_layers, c.vision.act, c.vision.channels) == (64, 3, "quick_gelu", 3)
    assert c.encoder_layers_run == 2 and c.image_tokens == 16 and c.vision.seq_len == 17
    assert (c.llm.hidden, c.llm.num_layers, c.llm.vocab_size, c.projector_hidden) == (128, 2, 1000, 128)
    assert c.image_token == 999
    spec = VLMSpec.from_config(c)
    assert sum(layer.kind == LayerKind.ENCODER for layer in spec.layers) == 2
    # A partial text_config (as llava-1.5-7b-hf ships) takes LlamaConfig's defaults.
    d = _tiny_llava()
    d["text_config"] = {"model_type": "llama", "vocab_size": 32064}
    assert hf_dict_to_vlm_config(d).llm.hidden == 4096


def test_qwen2_vl_config_json(tmp_path):
    d = {"model_type": "qwen2_vl", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "rope_theta": 1e6,
         "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
         "vision_config": {"depth": 2, "embed_dim": 64, "mlp_ratio": 4, "num_heads": 4, "in_chans": 3,
                           "hidden_size": 128, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}}
    (tmp_path / "config.json").write_text(json.dumps(d))
    c = resolve_vlm_config(str(tmp_path / "config.json"))
    assert c.image_token_id is None and c.image_token == 999  # no id given: the last of the vocabulary
    assert c.family == "qwen2_vl" and c.llm.family == "qwen2" and c.llm.qkv_bias
    assert hf_dict_to_vlm_config({**d, "image_token_id": 997}).image_token == 997
    assert c.projector.merge == 2 and c.projector_in == 256 and c.vision.patch_dim == 3 * 2 * 16
    assert c.image_tokens == (448 // 4) ** 2 // 4


def test_bad_vlm_configs_answer_in_one_line():
    d = _tiny_llava()
    d["vision_config"]["model_type"] = "dino"
    with pytest.raises(TesseraError, match="vision_config.model_type 'dino' is not supported"):
        hf_dict_to_vlm_config(d)
    d = _tiny_llava()
    d["vision_config"]["image_size"] = 30
    with pytest.raises(TesseraError, match="image_size=30 is not divisible by patch_size=8"):
        hf_dict_to_vlm_config(d)
    d = _tiny_llava()
    d["image_token_index"] = 1000
    with pytest.raises(TesseraError, match="image_token_index=1000 is not a token id of the LLM's vocabulary of 1000"):
        hf_dict_to_vlm_config(d)
    with pytest.raises(TesseraError, match="unknown multimodal model 'nope'"):
        resolve_vlm_config("nope")


def test_image_token_id_of_the_example_llava_config():
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples/tiny-llava/config.json"
    c = resolve_vlm_config(str(example))
    assert c.image_token_id == json.loads(example.read_text())["image_token_index"] == 319
    d = _tiny_llava()
    d["image_token_index"] = 300
    assert hf_dict_to_vlm_config(d).image_token == 300
