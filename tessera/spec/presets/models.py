"""Model presets: published architectures, and a `tiny-*` family that trains on a CPU.

Each figure is the one in the model's released `config.json` (Hugging Face hub) or paper.
"""
from __future__ import annotations

from ..model import ModelSpec, TransformerConfig

_GPT2 = dict(family="gpt2", vocab_size=50257, max_seq_len=1024, norm="layernorm", mlp="gelu",
             position="learned", linear_bias=True, tie_embeddings=True)
_LLAMA2 = dict(family="llama", vocab_size=32000, max_seq_len=4096, rope_theta=10000.0)
_LLAMA3 = dict(family="llama", vocab_size=128256, max_seq_len=8192, rope_theta=500000.0)
_QWEN25 = dict(family="qwen2", vocab_size=152064, max_seq_len=32768, qkv_bias=True,
               rope_theta=1000000.0, norm_eps=1e-6)

MODEL_CONFIGS: dict[str, TransformerConfig] = {
    c.name: c
    for c in [
        # GPT-2 (Radford et al. 2019): 124M, 355M, 774M, 1.5B.
        TransformerConfig(name="gpt2", hidden=768, num_layers=12, num_heads=12, num_kv_heads=12,
                          ffn_hidden=3072, **_GPT2),
        TransformerConfig(name="gpt2-medium", hidden=1024, num_layers=24, num_heads=16,
                          num_kv_heads=16, ffn_hidden=4096, **_GPT2),
        TransformerConfig(name="gpt2-large", hidden=1280, num_layers=36, num_heads=20,
                          num_kv_heads=20, ffn_hidden=5120, **_GPT2),
        TransformerConfig(name="gpt2-xl", hidden=1600, num_layers=48, num_heads=25,
                          num_kv_heads=25, ffn_hidden=6400, **_GPT2),
        # GPT-3 175B (Brown et al. 2020, table 2.1), GPT-2 style blocks without tied biases matter.
        TransformerConfig(name="gpt3-175b", family="gpt2", vocab_size=50257, max_seq_len=2048,
                          hidden=12288, num_layers=96, num_heads=96, num_kv_heads=96,
                          ffn_hidden=49152, norm="layernorm", mlp="gelu", position="learned",
                          linear_bias=True, tie_embeddings=True),
        # LLaMA-2 (Touvron et al. 2023).
        TransformerConfig(name="llama2-7b", hidden=4096, num_layers=32, num_heads=32,
                          num_kv_heads=32, ffn_hidden=11008, **_LLAMA2),
        TransformerConfig(name="llama2-13b", hidden=5120, num_layers=40, num_heads=40,
                          num_kv_heads=40, ffn_hidden=13824, **_LLAMA2),
        TransformerConfig(name="llama2-70b", hidden=8192, num_layers=80, num_heads=64,
                          num_kv_heads=8, ffn_hidden=28672, **_LLAMA2),
        # LLaMA-3 / 3.1 (Dubey et al. 2024).
        TransformerConfig(name="llama3-8b", hidden=4096, num_layers=32, num_heads=32,
                          num_kv_heads=8, ffn_hidden=14336, **_LLAMA3),
        TransformerConfig(name="llama3-70b", hidden=8192, num_layers=80, num_heads=64,
                          num_kv_heads=8, ffn_hidden=28672, **_LLAMA3),
        TransformerConfig(name="llama3-405b", hidden=16384, num_layers=126, num_heads=128,
                          num_kv_heads=8, ffn_hidden=53248, **_LLAMA3),
        # Qwen2.5 (Qwen team 2024).
        TransformerConfig(name="qwen2.5-7b", hidden=3584, num_layers=28, num_heads=28,
                          num_kv_heads=4, ffn_hidden=18944, **_QWEN25),
        TransformerConfig(name="qwen2.5-72b", hidden=8192, num_layers=80, num_heads=64,
                          num_kv_heads=8, ffn_hidden=29568, **_QWEN25),
        # Mixtral 8x7B (Jiang et al. 2024): 8 experts, top-2, every layer.
        TransformerConfig(name="mixtral-8x7b", family="mixtral", vocab_size=32000, hidden=4096,
                          num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
                          max_seq_len=32768, rope_theta=1000000.0, num_experts=8, top_k=2,
                          router_aux_loss_coef=0.02),
        # Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B (Qwen team 2024): softmax over all experts, then
        # top-k (not renormalised); a sigmoid-gated shared expert; experts in every layer.
        TransformerConfig(name="qwen1.5-moe-a2.7b", family="qwen2_moe", vocab_size=151936, hidden=2048,
                          num_layers=24, num_heads=16, num_kv_heads=16, ffn_hidden=1408, max_seq_len=8192,
                          rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, num_experts=60, top_k=4,
                          router="softmax_topk", shared_expert_ffn=5632, router_aux_loss_coef=0.001),
        TransformerConfig(name="qwen2-57b-a14b", family="qwen2_moe", vocab_size=151936, hidden=3584,
                          num_layers=28, num_heads=28, num_kv_heads=4, ffn_hidden=2560, max_seq_len=32768,
                          rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, num_experts=64, top_k=8,
                          router="softmax_topk", shared_expert_ffn=20480, router_aux_loss_coef=0.001),
        # CPU-sized models for tests and the default local training run.
        TransformerConfig(name="tiny-llama", hidden=256, num_layers=4, num_heads=8,
                          num_kv_heads=4, ffn_hidden=688, vocab_size=50257, max_seq_len=512),
        TransformerConfig(name="tiny-gpt2", hidden=256, num_layers=4, num_heads=8, num_kv_heads=8,
                          ffn_hidden=1024, **{**_GPT2, "max_seq_len": 512}),
        TransformerConfig(name="tiny-moe", family="mixtral", hidden=256, num_layers=4,
                          num_heads=8, num_kv_heads=4, ffn_hidden=512, vocab_size=50257,
                          max_seq_len=512, num_experts=4, top_k=2, router_aux_loss_coef=0.01),
        TransformerConfig(name="tiny-qwen-moe", family="qwen2_moe", hidden=256, num_layers=4,
                          num_heads=8, num_kv_heads=4, ffn_hidden=256, vocab_size=50257, max_seq_len=512,
                          qkv_bias=True, num_experts=8, top_k=2, router="softmax_topk", shared_expert_ffn=512,
                          router_aux_loss_coef=0.01),
        # A ~1B LLaMA for single-GPU checks (TinyLlama-1.1B shape).
        TransformerConfig(name="llama-1b", hidden=2048, num_layers=22, num_heads=32,
                          num_kv_heads=4, ffn_hidden=5632, vocab_size=32000, max_seq_len=2048),
    ]
}


class UnknownModelError(ValueError):
    pass


def model_names() -> list[str]:
    return sorted(MODEL_CONFIGS)


def get_model_config(name: str) -> TransformerConfig:
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model '{name}'; known models: {', '.join(model_names())} "
            "(or give the path of a Hugging Face config.json)"
        ) from None


def get_model(name: str) -> ModelSpec:
    return ModelSpec.from_config(get_model_config(name))
