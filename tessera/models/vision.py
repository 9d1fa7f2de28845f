"""A vision encoder (ViT), its projector, and a LLaVA-style vision-language model.

    images (N, C, H, W) --patchify--> (N, P, C*p*p) --patch_embed + pos_embeddings--> (N, P, d_enc)
        --pre-norm blocks, bidirectional attention--> norm --projector (Linear, GELU, Linear)-->
        (N, P, d_llm): P image tokens per image, P = (H / p) * (W / p)

The LLM's token sequence holds P placeholder tokens (`image_token_id`) per image, images in the
order their placeholders appear (row-major over the batch); the embedding of each placeholder is
replaced by the image token in that order (`splice_images`), everything else is the decoder-only
`Transformer` unchanged. The loss covers text tokens only: the data marks every label whose
target is an image placeholder or padding as ignored (-100).

Module names: the encoder's blocks are `tessera.models.transformer.Block`s (same `attention.wq`,
`feed_forward.w1` names, so a tensor-parallel plan can name them) whose attention core is
bidirectional (`attend(..., causal=False)`); the patch embedding is a linear layer over flattened
patches (a strided convolution with kernel = stride = p is the same map: its weight
(d, C, p, p) flattened is this weight, which is how Hugging Face checkpoints load into it).

Initial values follow `tessera.models.init` (every value depends on (seed, name) only, so any rank
draws any shard): the LLM's parameters get exactly the values of `Transformer.init_weights` (its
names without the `llm.` prefix), the encoder's and the projector's are drawn under their own
prefixed names (`vision.`, `projector.`), residual projections scaled by their own depth.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..spec.model import TransformerConfig
from .attention import attend
from .init import init_piece
from .transformer import Block, Transformer

VISION_PREFIX, PROJECTOR_PREFIX, LLM_PREFIX = "vision.", "projector.", "llm."


def encoder_block_config(vision) -> TransformerConfig:
    """The `TransformerConfig` whose `Block` is one encoder block of `vision` (a
    `VisionEncoderConfig`): LayerNorm, GELU MLP, biases on every linear layer (CLIP / SigLIP)."""
    return TransformerConfig(
        name=f"{vision.name}-blocks", vocab_size=1, hidden=vision.hidden, num_layers=vision.num_layers,
        num_heads=vision.num_heads, num_kv_heads=vision.num_heads, ffn_hidden=vision.ffn_hidden,
        max_seq_len=num_patches(vision), norm="layernorm", norm_eps=vision.norm_eps, mlp="gelu",
        position="learned", qkv_bias=True, linear_bias=True)


def num_patches(vision) -> int:
    """Image tokens per image: (image_size / patch_size)^2."""
    return (vision.image_size // vision.patch_size) ** 2


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, (H/p) * (W/p), C * p * p), patches row-major, each flattened (c, y, x)."""
    n, c, h, w = images.shape
    x = images.reshape(n, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(n, (h // patch) * (w // patch), c * patch * patch)


def check_images(images: torch.Tensor, vision) -> None:
    """One sentence when `images` is not (N, channels, image_size, image_size) for `vision`."""
    want = (vision.num_channels, vision.image_size, vision.image_size)
    if images.dim() != 4 or tuple(images.shape[1:]) != want:
        raise ValueError(f"images must be (N, {want[0]}, {want[1]}, {want[2]}) for the encoder "
                         f"{vision.name}, got {tuple(images.shape)}")


class BidirectionalAttention(nn.Module):
    """The attention core of an encoder block: every patch sees every patch of its image."""

    def forward(self, q, k, v, docs=None) -> torch.Tensor:
        return attend(q, k, v, docs, causal=False)


class VisionEncoder(nn.Module):
    """ViT: patch embedding, learned positions, pre-norm blocks, final norm; (N, P, hidden) out."""

    def __init__(self, vision):
        super().__init__()
        self.vision = vision
        self.patch = vision.patch_size
        blocks = encoder_block_config(vision)
        self.patch_embed = nn.Linear(vision.num_channels * vision.patch_size ** 2, vision.hidden, bias=True)
        self.pos_embeddings = nn.Embedding(num_patches(vision), vision.hidden)
        self.layers = nn.ModuleDict({str(i): Block(blocks, i) for i in range(vision.num_layers)})
        for block in self.layers.values():
            block.attention.core = BidirectionalAttention()
        self.norm = nn.LayerNorm(vision.hidden, eps=vision.norm_eps)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        check_images(images, self.vision)
        x = self.patch_embed(patchify(images.to(self.patch_embed.weight.dtype), self.patch))
        x = x + self.pos_embeddings.weight[None]
        for block in self.layers.values():
            x = block(x)
        return self.norm(x)


class Projector(nn.Module):
    """Encoder features to LLM embeddings: Linear(d_enc, d_llm), GELU, Linear(d_llm, d_llm)
    (LLaVA-1.5's two-layer MLP)."""

    def __init__(self, encoder_hidden: int, llm_hidden: int):
        super().__init__()
        self.w1 = nn.Linear(encoder_hidden, llm_hidden, bias=True)
        self.w2 = nn.Linear(llm_hidden, llm_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class ImageEncoder(nn.Module):
    """Encoder + projector: the part of a VLM that runs per image, (N, C, H, W) -> (N, P, d_llm).
    Its parameter names are the VLM's (`vision.*`, `projector.*`)."""

    def __init__(self, vision, llm_hidden: int):
        super().__init__()
        self.vision = VisionEncoder(vision)
        self.projector = Projector(vision.hidden, llm_hidden)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision(images))


def scatter_images(tokens: torch.Tensor, features: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """(B, S, d) tensor holding the image tokens `features` (N, P, d) at the placeholder positions
    of `tokens` (B, S), in row-major order, zeros elsewhere."""
    mask = tokens == image_token_id
    placeholders, supplied = int(mask.sum()), features.shape[0] * features.shape[1]
    if placeholders != supplied:
        raise ValueError(f"the batch has {placeholders} image placeholder tokens (id {image_token_id}) but "
                         f"{features.shape[0]} images of {features.shape[1]} tokens each ({supplied})")
    out = features.new_zeros(*tokens.shape, features.shape[-1])
    return out.masked_scatter(mask[..., None], features)


def splice_images(embeddings: torch.Tensor, tokens: torch.Tensor, images: torch.Tensor,
                  image_token_id: int) -> torch.Tensor:
    """Token embeddings (B, S, d) with each placeholder's row replaced by the image token at the same
    place of `images` (B, S, d) (from `scatter_images`). The placeholders' own embedding gets no
    gradient."""
    mask = (tokens == image_token_id)[..., None]
    return torch.where(mask, images.to(embeddings.dtype), embeddings)


class ImageSplice:
    """Forward hook of an LLM's token embedding that splices in the image tokens of the current
    forward: `images` is set to a (B, S, d) tensor from `scatter_images` over the rows the
    embedding's caller holds, `take` maps it to the embedding's own block of rows and sequence
    (identity in one process; a parallel chunk's data block otherwise)."""

    def __init__(self, image_token_id: int, take=None):
        self.image_token_id = image_token_id
        self.take = take or (lambda x: x)
        self.images: torch.Tensor | None = None

    def __call__(self, module, args, output):
        if self.images is None:
            return output
        return splice_images(output, args[0], self.take(self.images), self.image_token_id)


class VisionLanguageModel(nn.Module):
    """Encoder + projector + decoder LLM in one process (the reference the runtime is tested against).

    `forward(tokens (B, S), images (N, C, H, W))` -> logits (B, S, vocab). Submodules `vision`,
    `projector` (as in `ImageEncoder`) and `llm` (a `Transformer`)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vision = VisionEncoder(config.vision)
        self.projector = Projector(config.vision.hidden, config.llm.hidden)
        self.llm = Transformer(config.llm)
        self.splice = ImageSplice(config.image_token_id)
        self.llm.tok_embeddings.register_forward_hook(self.splice)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision(images))

    def forward(self, tokens: torch.Tensor, images: torch.Tensor | None,
                positions: torch.Tensor | None = None, doc_ids=None) -> torch.Tensor:
        if images is not None and images.shape[0]:
            self.splice.images = scatter_images(tokens, self.encode(images), self.config.image_token_id)
        try:
            return self.llm(tokens, positions, doc_ids)
        finally:
            self.splice.images = None

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        self.llm.init_weights(seed, std)
        for name, p in self.named_parameters():
            if not name.startswith(LLM_PREFIX):
                p.copy_(init_value(name, p.shape, seed, self.config, std))


def init_value(name: str, shape, seed: int, config, std: float = 0.02, offset=None, piece_shape=None) -> torch.Tensor:
    """The initial value of VLM parameter `name` (or of its rectangle at `offset`), see the module
    docstring: LLM parameters as the plain LLM draws them, encoder blocks scaled by the encoder's
    depth, the projector as a one-layer network."""
    if name.startswith(LLM_PREFIX):
        return init_piece(name.removeprefix(LLM_PREFIX), shape, seed, config.llm.num_layers, std, offset, piece_shape)
    depth = config.vision.num_layers if name.startswith(VISION_PREFIX) else 1
    return init_piece(name, shape, seed, depth, std, offset, piece_shape)


def build_vlm(config, seed: int = 0, device: str | torch.device = "cpu") -> VisionLanguageModel:
    with torch.device(device):
        model = VisionLanguageModel(config)
    if str(device) != "meta":
        model.init_weights(seed)
    return model


def build_image_encoder(config, device: str | torch.device = "meta") -> ImageEncoder:
    """The encoder + projector alone (the runtime places them apart from the LLM)."""
    with torch.device(device):
        return ImageEncoder(config.vision, config.llm.hidden)
