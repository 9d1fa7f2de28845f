"""HF checkpoints <-> Tessera: logits match transformers, export round-trips, `tessera convert` works.

Small random models are built with `transformers` from a config (no download). Weights are
re-drawn with a large spread and random norm gains so that any mismatch in layout or numerics
(RoPE layout, GELU variant, eps, attention scale, MoE routing) shows far above 1e-5.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tessera.cli import main as cli_main
from tessera.errors import TesseraError
from tessera.models import hf
from tessera.spec.hf_config import hf_dict_to_config
from tessera.models.transformer import build_model
from tessera.spec.presets import get_model_config

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
HF_MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, rope_theta=500.0)),
    "llama-bias": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=72,
        norm_topk_prob=True)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=None,
        eos_token_id=None)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "ln" in name or "norm" in name else 0.15 * noise)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def hf_checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    model = HF_MODELS[request.param]().eval()
    _randomize(model, seed=1)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(path)
    return request.param, model, path


def test_import_matches_hf_logits_and_export_round_trips(hf_checkpoint, tmp_path):
    family, hf_model, path = hf_checkpoint
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    expected = _hf_logits(hf_model, tokens)

    model = hf.load_pretrained(path).eval()
    assert model.config.family == family.removesuffix("-bias")
    with torch.no_grad():
        got = model(tokens)
    assert expected.abs().max() > 1.0  # weights large enough that a layout error would show
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    # Tessera -> HF -> Tessera is exact, tensor by tensor.
    sd = hf.model_state_dict(model)
    hf.save_hf_checkpoint(model.config, sd, tmp_path / "export")
    cfg2, sd2 = hf.load_hf_checkpoint(tmp_path / "export")
    assert cfg2.model_dump(exclude={"name"}) == model.config.model_dump(exclude={"name"})
    assert sd2.keys() == sd.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    # The export holds exactly the tensors an HF save does, with the same values.
    original, exported = load_file(path / "model.safetensors"), load_file(tmp_path / "export/model.safetensors")
    assert original.keys() == exported.keys()
    for k in original:
        assert torch.equal(original[k], exported[k]), k

    # transformers loads the export and gives the same logits.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(reloaded) is type(hf_model)
    torch.testing.assert_close(_hf_logits(reloaded, tokens), expected, atol=1e-5, rtol=1e-5)


def test_packed_positions_match_hf_position_ids(tmp_path):
    """Per-token positions (restarting per packed document) mean the same as HF `position_ids`."""
    torch.manual_seed(0)
    hf_model = HF_MODELS["llama"]().eval()
    _randomize(hf_model, seed=3)
    hf_model.save_pretrained(tmp_path)
    model = hf.load_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 96, (1, 12))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        expected = hf_model(tokens, position_ids=positions).logits
        got = model(tokens, positions=positions)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_convert_cli_both_ways(tmp_path, capsys):
    torch.manual_seed(0)
    hf_model = HF_MODELS["gpt2"]().eval()
    _randomize(hf_model, seed=4)
    hf_model.save_pretrained(tmp_path / "hf")
    assert cli_main(["convert", "hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "ts")]) == 0
    assert "converted" in capsys.readouterr().out
    saved = json.loads((tmp_path / "ts/config.json").read_text())
    assert saved["family"] == "gpt2" and saved["hidden"] == 64
    assert "output.weight" not in load_file(tmp_path / "ts/model.safetensors")  # tied head not stored

    assert cli_main(["convert", "tessera-to-hf", str(tmp_path / "ts"), str(tmp_path / "back"),
                     "--dtype", "bfloat16"]) == 0
    back = load_file(tmp_path / "back/model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in back.values())
    assert json.loads((tmp_path / "back/config.json").read_text())["torch_dtype"] == "bfloat16"

    # An existing output is never overwritten by accident; a missing input is one line.
    assert cli_main(["convert", "tessera-to-hf", str(tmp_path / "ts"), str(tmp_path / "back")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["convert", "hf-to-tessera", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and len(err.strip().splitlines()) == 1


def test_tessera_checkpoint_round_trip_and_bad_input(tmp_path):
    cfg = get_model_config("tiny-moe").model_copy(update=dict(num_layers=2, vocab_size=128, hidden=64,
                                                               ffn_hidden=96, num_heads=4, num_kv_heads=2))
    model = build_model(cfg, seed=5)
    hf.save_tessera_checkpoint(cfg, hf.model_state_dict(model), tmp_path / "ts")
    loaded = hf.load_pretrained(tmp_path / "ts")
    assert loaded.config == cfg
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k

    # A Mixtral export of a Tessera MoE model loads in transformers with the same logits.
    hf.save_hf_checkpoint(cfg, hf.model_state_dict(model), tmp_path / "hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model.eval()(tokens), atol=1e-5, rtol=1e-5)

    # A weight of the wrong shape is refused before anything is written.
    sd = hf.model_state_dict(model)
    sd["norm.weight"] = torch.ones(3)
    with pytest.raises(TesseraError, match="norm.weight.*shape"):
        hf.save_hf_checkpoint(cfg, sd, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    # An HF file with a tensor Tessera has no place for is named.
    hf_sd = load_file(tmp_path / "hf/model.safetensors")
    with pytest.raises(TesseraError, match="model.layers.0.extra"):
        hf.hf_to_tessera_state_dict({**hf_sd, "model.layers.0.extra.weight": torch.ones(1)}, cfg)
    # A model that the HF architecture cannot express is refused with the reason.
    with pytest.raises(TesseraError, match="moe_every"):
        hf.save_hf_checkpoint(cfg.model_copy(update=dict(moe_every=2)), hf.model_state_dict(model), tmp_path / "x")


def test_scaled_rope_checkpoint_is_refused(tmp_path):
    hf_model = HF_MODELS["llama"]()
    hf_model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TesseraError, match="rope_type='llama3'"):
        hf.load_hf_checkpoint(tmp_path)


def test_moe_block_trains():
    """tiny-moe's blocks (vocabulary cut to 1,000 for speed): a few SGD steps on a fixed batch lower
    the loss, and the router and several experts receive gradients."""
    model = build_model(get_model_config("tiny-moe").model_copy(update=dict(vocab_size=1000)), seed=0)
    tokens = torch.randint(0, 1000, (2, 33), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(4):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        model.zero_grad()
        loss.backward()
        if not losses:
            moe = model.layers["0"].moe
            assert moe.gate.weight.grad.abs().sum() > 0
            assert sum(e.w1.weight.grad is not None and e.w1.weight.grad.abs().sum() > 0 for e in moe.experts) >= 2
        with torch.no_grad():  # plain SGD, lr 0.5 (torch.optim would import torch._dynamo: seconds)
            for p in model.parameters():
                if p.grad is not None:  # an expert no token chose has no gradient
                    p -= 0.5 * p.grad
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_legacy_hub_key_layouts_import_the_same():
    """Old hub files: GPT-2 without the `transformer.` prefix and with attention-mask buffers,
    LLaMA with `rotary_emb.inv_freq` buffers, Mixtral in the fused transformers-5 layout."""
    for family, extra in (("gpt2", {"h.0.attn.bias": torch.ones(1, 1, 64, 64), "h.0.attn.masked_bias": torch.ones(())}),
                          ("llama", {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})):
        hf_model = HF_MODELS[family]()
        cfg = hf_dict_to_config(hf_model.config.to_dict())
        sd = hf_model.state_dict()
        expected = hf.hf_to_tessera_state_dict(sd, cfg)
        legacy = {k.removeprefix("transformer."): v for k, v in sd.items()} | extra
        got = hf.hf_to_tessera_state_dict(legacy, cfg)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    mixtral = HF_MODELS["mixtral"]().eval()
    _randomize(mixtral, seed=6)
    cfg = hf_dict_to_config(mixtral.config.to_dict())
    fused = mixtral.state_dict()  # in memory, transformers 5 fuses the experts
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    tessera_sd = hf.hf_to_tessera_state_dict(fused, cfg)
    model = build_model(cfg)
    hf.load_state_dict_strict(model, tessera_sd)
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():  # gate rows come before up rows in gate_up_proj
        torch.testing.assert_close(model.eval()(tokens), mixtral(tokens).logits, atol=1e-5, rtol=1e-5)
    per_expert = hf.tessera_to_hf_state_dict(tessera_sd, cfg)
    back = hf.hf_to_tessera_state_dict(per_expert, cfg)
    assert all(torch.equal(back[k], tessera_sd[k]) for k in back)
