"""What a vision-language model is: a vision encoder (ViT), a projector, and a decoder LLM.

`VLMConfig` holds the hyper-parameters the runtime builds the torch modules from:
    VisionEncoderConfig  the ViT: patch embedding (a conv of stride = kernel = patch_size over
                         `channels` x `temporal_patch_size` frames), an optional class token,
                         learned or 2-D rotary positions, `num_layers` pre-norm blocks with
                         bidirectional attention;
    ProjectorConfig      maps encoder features to LLM embeddings: `merge` x `merge` neighbouring
                         patches concatenated (Qwen2-VL's PatchMerger, InternVL's pixel shuffle;
                         1 = none), an optional norm over the merged vector, then `layers` linears
                         (2 = Linear, GELU, Linear as in LLaVA-1.5) to the LLM's hidden size;
    TransformerConfig    the LLM, unchanged (`tessera.spec.model`).

`VLMSpec` is the planner's view: three `ModelSpec`-like parts priced by the existing cost model,
each with its own sequence length (the encoder's is the patches of one image, the LLM's the text
plus image tokens), so that the planner can give them their own strategies. `VLMSpec.layers` is
the whole model in execution order: patch embedding, encoder blocks (LayerKind.ENCODER), the
projector (LayerKind.PROJECTOR), embedding, decoder blocks, LM head.

Token accounting per image: the encoder runs `encoder_seq_len` = patches (+1 class token)
tokens; the LLM receives `image_tokens` = patches / merge^2 (LLaVA's "default" feature selection
drops the class token; "full" keeps it).

Plain data, no torch import. Presets are shaped like public checkpoints (figures from their
released `config.json`); `tessera.spec.hf_vlm` reads such a file.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ..errors import TesseraError
from .model import Frozen, LayerKind, LayerSpec, Matmul, ModelSpec, TransformerConfig, block_layer
from .presets.models import MODEL_CONFIGS

# Model parts a multi-task workload may name (tasks.yaml): which parts a task's samples run.
MODEL_PARTS = ("vision_encoder", "projector", "llm")


class VisionEncoderConfig(Frozen):
    """A ViT (CLIP / SigLIP / Qwen2-VL / InternViT shaped)."""

    name: str = "vit"
    family: Literal["clip", "siglip", "qwen2_vl", "intern_vit"] = "clip"
    image_size: int = Field(gt=0, description="side of the (square) input image, pixels")
    patch_size: int = Field(gt=0)
    channels: int = Field(default=3, gt=0)
    temporal_patch_size: int = Field(default=1, gt=0, description="frames per patch (Qwen2-VL: 2)")
    hidden: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    ffn_hidden: int = Field(gt=0)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    act: Literal["gelu", "quick_gelu", "gelu_tanh", "swiglu"] = "quick_gelu"
    position: Literal["learned", "rope2d"] = "learned"
    class_token: bool = True
    qkv_bias: bool = True
    linear_bias: bool = True  # biases on the output projection and the MLP
    qk_norm: bool = False  # InternViT normalises q and k
    layer_scale: bool = False  # InternViT scales each branch by a learned vector

    @model_validator(mode="after")
    def _check(self) -> "VisionEncoderConfig":
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}")
        return self

    @property
    def grid(self) -> int:
        """Patches along one side of the image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid ** 2

    @property
    def seq_len(self) -> int:
        """Tokens the encoder's attention runs over per image."""
        return self.num_patches + (1 if self.class_token else 0)

    @property
    def patch_dim(self) -> int:
        """Input features of one patch (pixels x channels x frames)."""
        return self.channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


class ProjectorConfig(Frozen):
    """Encoder features -> LLM embeddings (see the module docstring)."""

    merge: int = Field(default=1, ge=1, description="patches merged per side (2: 2x2 -> 1 token)")
    norm: bool = False  # a norm over the merged vector first (Qwen2-VL, InternVL)
    layers: int = Field(default=2, ge=1, le=2)
    hidden: int = Field(default=0, ge=0, description="width between the two linears (0: the LLM's hidden)")
    act: Literal["gelu", "quick_gelu", "gelu_tanh"] = "gelu"
    bias: bool = True


class VLMConfig(Frozen):
    """A vision encoder + projector + decoder LLM."""

    name: str
    family: Literal["llava", "qwen2_vl", "internvl", "custom"] = "llava"
    vision: VisionEncoderConfig
    projector: ProjectorConfig = ProjectorConfig()
    llm: TransformerConfig
    # Which encoder layer's output feeds the projector (-1 the last; LLaVA -2: the last block is
    # never used, so the planner and the runtime run `encoder_layers_run` blocks).
    feature_layer: int = -1
    # "default": the class token is dropped before the projector (LLaVA); "full": kept.
    feature_select: Literal["default", "full"] = "default"
    # The LLM token id that marks an image token's place in the text (Hugging Face LLaVA's
    # `image_token_index`, Qwen2-VL's `image_token_id`); None: the last id of the LLM's vocabulary.
    image_token_id: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "VLMConfig":
        v = self.vision
        if self.image_token_id is not None and self.image_token_id >= self.llm.vocab_size:
            raise ValueError(f"image_token_id={self.image_token_id} is outside the LLM's vocabulary of "
                             f"{self.llm.vocab_size}")
        if v.grid % self.projector.merge:
            raise ValueError(f"projector merge={self.projector.merge} does not divide the {v.grid}x{v.grid} "
                             f"patch grid (image_size={v.image_size}, patch_size={v.patch_size})")
        if not (-v.num_layers <= self.feature_layer < 0 or 1 <= self.feature_layer <= v.num_layers):
            raise ValueError(f"feature_layer={self.feature_layer} is outside the encoder's {v.num_layers} layers")
        if self.projector.merge > 1 and v.class_token and self.feature_select == "full":
            raise ValueError("a class token cannot be merged with patches (feature_select='full' with merge > 1)")
        return self

    @property
    def image_token(self) -> int:
        """The image placeholder id the runtime and the data use (`image_token_id`, else the last id)."""
        return self.llm.vocab_size - 1 if self.image_token_id is None else self.image_token_id

    @property
    def encoder_layers_run(self) -> int:
        """Encoder blocks whose output reaches the LLM (HF hidden_states index semantics)."""
        n = self.vision.num_layers
        return n + 1 + self.feature_layer if self.feature_layer < 0 else self.feature_layer

    @property
    def projector_in(self) -> int:
        return self.vision.hidden * self.projector.merge ** 2

    @property
    def projector_hidden(self) -> int:
        return self.projector.hidden or self.llm.hidden

    @property
    def image_tokens(self) -> int:
        """LLM tokens per image."""
        keep_cls = self.vision.class_token and self.feature_select == "full"
        return self.vision.num_patches // self.projector.merge ** 2 + (1 if keep_cls else 0)


def _norm_params(norm: str, width: int) -> int:
    return 2 * width if norm == "layernorm" else width


def _as_transformer(v: VisionEncoderConfig) -> TransformerConfig:
    """The encoder block's shape in the decoder block's terms (the per-token costs are the same;
    attention FLOPs differ and are set by `encoder_block_layer`)."""
    return TransformerConfig(
        name=v.name, family="llama", vocab_size=1, hidden=v.hidden, num_layers=v.num_layers,
        num_heads=v.num_heads, num_kv_heads=v.num_heads, ffn_hidden=v.ffn_hidden, max_seq_len=v.seq_len,
        norm=v.norm, norm_eps=v.norm_eps, mlp="swiglu" if v.act == "swiglu" else "gelu",
        position="rope" if v.position == "rope2d" else "learned",
        qkv_bias=v.qkv_bias, linear_bias=v.linear_bias)


def patch_embedding_layer(v: VisionEncoderConfig) -> LayerSpec:
    """Conv patch embedding (a GEMM of patch_dim -> hidden per patch), class token, positions."""
    params = v.patch_dim * v.hidden + (v.hidden if v.linear_bias else 0)
    params += v.hidden if v.class_token else 0
    params += v.seq_len * v.hidden if v.position == "learned" else 0
    if v.family == "clip":
        params += _norm_params(v.norm, v.hidden)  # CLIP's pre-layernorm
    return LayerSpec(name="patch_embed", kind=LayerKind.EMBEDDING, hidden=v.hidden, params=params,
                     flops_per_token=2.0 * v.patch_dim * v.hidden,
                     matmuls=(Matmul(n=v.hidden, k=v.patch_dim),),
                     act_bytes_input=2.0 * v.patch_dim, act_bytes_replicated=2.0 * v.patch_dim,
                     elementwise_bytes_replicated=2.0 * 3 * v.hidden, kernels=3)


def encoder_block_layer(v: VisionEncoderConfig, index: int) -> LayerSpec:
    """A pre-norm ViT block. Bidirectional attention: QK^T and AV cost 2 x 2 s d FLOPs per token
    (nothing masked), twice a causal block's `attn_flops_coeff`."""
    base = block_layer(_as_transformer(v), index)
    # The decoder block counts q/k/v biases whenever the linears have biases (GPT-2); InternViT
    # has an output-projection bias without q/k/v biases. Its q and k norms span all heads.
    extra = -3 * v.hidden if (v.linear_bias and not v.qkv_bias) else 0
    extra += 2 * _norm_params(v.norm, v.hidden) if v.qk_norm else 0
    extra += 2 * v.hidden if v.layer_scale else 0
    return base.model_copy(update=dict(name=f"vit{index}", kind=LayerKind.ENCODER, params=base.params + extra,
                                       attn_flops_coeff=4.0 * v.hidden))


def projector_layer(c: VLMConfig) -> LayerSpec:
    """Optional norm, then Linear(in, mid) [+ act + Linear(mid, llm hidden)]; per LLM image token."""
    p, h_in, h_out = c.projector, c.projector_in, c.llm.hidden
    mid = c.projector_hidden if p.layers == 2 else h_out
    mats = (Matmul(n=mid, k=h_in),) + ((Matmul(n=h_out, k=mid, shard="row"),) if p.layers == 2 else ())
    params = sum(m.n * m.k for m in mats) + ((mid + (h_out if p.layers == 2 else 0)) if p.bias else 0)
    params += _norm_params(c.vision.norm, h_in) if p.norm else 0
    acts = 2.0 * h_in + (2.0 * 2 * mid if p.layers == 2 else 0.0)  # input, fc1 and act outputs
    return LayerSpec(name="projector", kind=LayerKind.PROJECTOR, hidden=h_out, params=params,
                     flops_per_token=2.0 * sum(m.n * m.k for m in mats), matmuls=mats,
                     act_bytes_tp=2.0 * 2 * mid if p.layers == 2 else 0.0,
                     act_bytes_replicated=2.0 * h_in, act_bytes_input=2.0 * h_in, bwd_transient=acts,
                     elementwise_bytes_tp=4.0 * mid if p.layers == 2 else 0.0,
                     elementwise_bytes_replicated=(4.0 * h_in if p.norm else 0.0), kernels=len(mats) + 2)


class VLMSpec(Frozen):
    """The planner's view of a VLM: the encoder (patch embedding + blocks, sequence = one image's
    patches), the projector (per image token) and the LLM (`ModelSpec.from_config`)."""

    name: str
    config: VLMConfig
    encoder: ModelSpec
    projector: LayerSpec
    llm: ModelSpec

    @classmethod
    def from_config(cls, c: VLMConfig) -> "VLMSpec":
        v = c.vision
        enc_layers = (patch_embedding_layer(v),) + tuple(encoder_block_layer(v, i) for i in range(c.encoder_layers_run))
        return cls(name=c.name, config=c, encoder=ModelSpec(name=f"{c.name}/vision_encoder", layers=enc_layers),
                   projector=projector_layer(c), llm=ModelSpec.from_config(c.llm))

    @property
    def layers(self) -> tuple[LayerSpec, ...]:
        """Every layer in execution order."""
        return self.encoder.layers + (self.projector,) + self.llm.layers

    @property
    def encoder_seq_len(self) -> int:
        return self.config.vision.seq_len

    @property
    def image_tokens(self) -> int:
        return self.config.image_tokens

    @property
    def num_params(self) -> int:
        return self.encoder.num_params + self.projector.params + self.llm.num_params

    def encoder_and_projector(self) -> ModelSpec:
        """The encoder with the projector appended, every layer priced per encoder token (the
        unit of the encoder's workload: images x `encoder_seq_len`). The projector runs once per
        merge^2 patches: its first linear per encoder token is (vision hidden -> mid) and its
        second (mid -> llm hidden / merge^2), the same FLOPs; its activations scale by 1/merge^2."""
        r = self.config.projector.merge ** 2
        p = self.projector
        if r == 1:
            return ModelSpec(name=f"{self.name}/vision_encoder+projector", layers=self.encoder.layers + (p,))
        first, *rest = p.matmuls
        mats = (Matmul(n=first.n, k=first.k // r, shard=first.shard),) + tuple(
            Matmul(n=max(1, m.n // r), k=m.k, shard=m.shard) for m in rest)
        scaled = {f: getattr(p, f) / r for f in ("flops_per_token", "act_bytes_tp", "act_bytes_replicated",
                                                 "act_bytes_input", "bwd_transient", "elementwise_bytes_tp",
                                                 "elementwise_bytes_replicated")}
        return ModelSpec(name=f"{self.name}/vision_encoder+projector",
                         layers=self.encoder.layers + (p.model_copy(update=dict(matmuls=mats, **scaled)),))

    def part(self, name: str) -> ModelSpec:
        """One part as a ModelSpec: 'vision_encoder', 'projector' or 'llm'."""
        if name == "vision_encoder":
            return self.encoder
        if name == "projector":
            return ModelSpec(name=f"{self.name}/projector", layers=(self.projector,))
        if name == "llm":
            return self.llm
        raise TesseraError(f"unknown model part '{name}'; the parts are {', '.join(MODEL_PARTS)}")


# --- presets --------------------------------------------------------------------------------

# CLIP ViT-L/14 at 336 px (openai/clip-vit-large-patch14-336): LLaVA-1.5's encoder.
CLIP_VIT_L14_336 = VisionEncoderConfig(name="clip-vit-l14-336", family="clip", image_size=336, patch_size=14,
                                       hidden=1024, num_layers=24, num_heads=16, ffn_hidden=4096, act="quick_gelu")
# Qwen2-VL's 675M ViT: 14 px patches over 2 frames, 2-D RoPE, no class token (fixed 448 px here;
# the model takes dynamic resolutions, 448 px = 1024 patches = 256 LLM tokens).
QWEN2_VL_VIT = VisionEncoderConfig(name="qwen2-vl-vit", family="qwen2_vl", image_size=448, patch_size=14,
                                   temporal_patch_size=2, hidden=1280, num_layers=32, num_heads=16, ffn_hidden=5120,
                                   norm_eps=1e-6, act="quick_gelu", position="rope2d", class_token=False)
# InternViT-6B (OpenGVLab/InternViT-6B-448px-V1-5): RMSNorm, q/k norm over the whole width,
# layer scale, no q/k/v bias (an output-projection bias): 5,536,496,000 parameters.
INTERN_VIT_6B = VisionEncoderConfig(name="intern-vit-6b", family="intern_vit", image_size=448, patch_size=14,
                                    hidden=3200, num_layers=45, num_heads=25, ffn_hidden=12800, norm="rmsnorm",
                                    norm_eps=1e-6, act="gelu", qkv_bias=False, qk_norm=True, layer_scale=True)
TINY_VIT = VisionEncoderConfig(name="tiny-vit", family="clip", image_size=32, patch_size=8, hidden=64,
                               num_layers=2, num_heads=4, ffn_hidden=256, act="gelu")

_VICUNA_7B = MODEL_CONFIGS["llama2-7b"].model_copy(update=dict(name="vicuna-7b", vocab_size=32064))
_QWEN2_7B = MODEL_CONFIGS["qwen2.5-7b"].model_copy(update=dict(name="qwen2-vl-7b-llm"))
# The tiny presets' LLM: tiny-llama with examples/tiny-llava's 320-token vocabulary (byte-level
# captions 0..255, end-of-text 256, the image placeholder 319), not GPT-2's 50,257 tokens.
_TINY_VLM_LLM = MODEL_CONFIGS["tiny-llama"].model_copy(update=dict(name="tiny-vlm-llm", vocab_size=320))

VLM_CONFIGS: dict[str, VLMConfig] = {c.name: c for c in [
    # llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14-336 (penultimate layer, class token dropped),
    # 2-layer GELU MLP 1024 -> 4096 -> 4096, Vicuna-7B.
    VLMConfig(name="llava-1.5-7b", family="llava", vision=CLIP_VIT_L14_336, feature_layer=-2,
              projector=ProjectorConfig(merge=1, layers=2, act="gelu"), llm=_VICUNA_7B),
    # Qwen/Qwen2-VL-7B-Instruct: 2x2 PatchMerger (LayerNorm, 5120 -> 5120 -> 3584), Qwen2-7B LLM.
    VLMConfig(name="qwen2-vl-7b", family="qwen2_vl", vision=QWEN2_VL_VIT,
              projector=ProjectorConfig(merge=2, norm=True, layers=2, hidden=1280 * 4, act="gelu"), llm=_QWEN2_7B),
    # InternVL-style: InternViT-6B, pixel shuffle 2x2, LayerNorm + 2-layer MLP, a 70B LLaMA-3 LLM.
    VLMConfig(name="vit6b-llama3-70b", family="internvl", vision=INTERN_VIT_6B,
              projector=ProjectorConfig(merge=2, norm=True, layers=2, act="gelu"), llm=MODEL_CONFIGS["llama3-70b"]),
    # CPU-sized: 32 px images, 16 patches, a tiny LLaMA.
    VLMConfig(name="tiny-vlm", family="llava", vision=TINY_VIT,
              projector=ProjectorConfig(merge=1, layers=2, act="gelu"), llm=_TINY_VLM_LLM, image_token_id=319),
    VLMConfig(name="tiny-qwen2-vl", family="qwen2_vl",
              vision=VisionEncoderConfig(name="tiny-qwen2-vl-vit", family="qwen2_vl", image_size=32, patch_size=4,
                                         temporal_patch_size=2, hidden=64, num_layers=2, num_heads=4, ffn_hidden=256,
                                         norm_eps=1e-6, act="quick_gelu", position="rope2d", class_token=False),
              projector=ProjectorConfig(merge=2, norm=True, layers=2, hidden=256, act="gelu"),
              llm=_TINY_VLM_LLM, image_token_id=319),
]}


def vlm_names() -> list[str]:
    return sorted(VLM_CONFIGS)


def is_vlm(name_or_path: str) -> bool:
    """Whether `name_or_path` names a VLM preset or a VLM `config.json` (llava / qwen2_vl)."""
    if name_or_path in VLM_CONFIGS:
        return True
    from .hf_vlm import is_vlm_config_file

    return is_vlm_config_file(name_or_path)


def resolve_vlm_config(name_or_path: str) -> VLMConfig:
    """A VLM preset by name, or a Hugging Face VLM `config.json` (file or directory)."""
    if name_or_path in VLM_CONFIGS:
        return VLM_CONFIGS[name_or_path]
    from .hf_vlm import is_vlm_config_file, load_hf_vlm_config

    if is_vlm_config_file(name_or_path):
        return load_hf_vlm_config(name_or_path)
    raise TesseraError(f"unknown multimodal model '{name_or_path}'; known: {', '.join(vlm_names())} "
                       "(or give the path of a llava / qwen2_vl config.json)")


def resolve_vlm(name_or_path: str) -> VLMSpec:
    return VLMSpec.from_config(resolve_vlm_config(name_or_path))
