"""A vision encoder (ViT), its projector, and a LLaVA-style vision-language model.

Built from a `tessera.spec.multimodal.VLMConfig` (`vision`, `projector`, `llm`):

    images (N, C, H, W) --patchify--> (N, P, C*T*p*p) --patch_embed [+ class token] [+ positions]
        [--pre-norm (CLIP)]--> `encoder_layers_run` pre-norm blocks, bidirectional attention
        [--drop the class token ("default")]--> projector: merge m x m neighbouring patches,
        [norm], Linear [, act, Linear] --> (N, image_tokens, d_llm)

The LLM's token sequence holds `image_tokens` placeholder tokens (`image_token_id`) per image,
images in the order their placeholders appear (row-major over the batch); each placeholder's
embedding is replaced by the image token at the same place (`splice_images`), the rest is the
decoder-only `Transformer` unchanged. The loss covers text tokens only: the data marks every
label whose target is an image placeholder or padding as ignored (-100).

Details:
- the patch embedding is a linear layer over flattened patches: a strided convolution with kernel
  = stride = p is the same map (its (d, C, T, p, p) weight flattened is this weight). A still
  image fed to a T-frame patch (Qwen2-VL, T = 2) is repeated T times, as its processor does;
- positions: learned (one per encoder token) or 2-D rotary ("rope2d": half of each head's
  rotary pairs turn with the patch row, half with the column, RoPE base 10,000);
- blocks: norm -> attention (optional q/k norm over each head, InternViT) -> [x layer scale] +
  residual; norm -> MLP (GELU, quick-GELU x sigmoid(1.702 x), tanh-GELU, or SwiGLU) -> [x scale] +
  residual. Module names follow the decoder block's (`attention.wq`, `feed_forward.w1`...), so a
  tensor-parallel plan can name them;
- the encoder's output is the hidden state after its last block run, without a final norm (what
  LLaVA and Qwen2-VL feed their projector); the projector's norm, when present, is over the
  merged vector (InternVL's pixel-shuffle MLP).

Initial values follow `tessera.models.init` (each value depends on (seed, name) only, so any rank
draws any shard): the LLM's parameters get exactly the values of `Transformer.init_weights` (its
names without the `llm.` prefix); the encoder's and the projector's are drawn under their own
names (`vision.`, `projector.`), residual projections scaled by the encoder's depth; layer scales
start at 0.1, norms at 1, biases at 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend
from .init import init_piece
from .transformer import Transformer, apply_rope

VISION_PREFIX, PROJECTOR_PREFIX, LLM_PREFIX = "vision.", "projector.", "llm."
LAYER_SCALE_INIT = 0.1


def image_token_id(config) -> int:
    """The placeholder id of an image token: `VLMConfig.image_token` (the config's `image_token_id`,
    Hugging Face's `image_token_index` / `image_token_id`, else the last id of the LLM's vocabulary)."""
    return config.image_token


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, (H/p) * (W/p), C * p * p), patches row-major, each flattened (c, y, x)."""
    n, c, h, w = images.shape
    x = images.reshape(n, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(n, (h // patch) * (w // patch), c * patch * patch)


def check_images(images: torch.Tensor, vision) -> None:
    """One sentence when `images` is not (N, channels, image_size, image_size) for `vision`."""
    want = (vision.channels, vision.image_size, vision.image_size)
    if images.dim() != 4 or tuple(images.shape[1:]) != want:
        raise ValueError(f"images must be (N, {want[0]}, {want[1]}, {want[2]}) for the encoder "
                         f"{vision.name}, got {tuple(images.shape)}")


def _norm(kind: str, width: int, eps: float) -> nn.Module:
    return nn.LayerNorm(width, eps=eps) if kind == "layernorm" else nn.RMSNorm(width, eps=eps)


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


def rope2d_frequencies(head_dim: int, grid: int, theta: float = 10000.0) -> torch.Tensor:
    """Complex rotations (grid * grid, head_dim / 2) of the patches, row-major: the first half of
    the pairs turns with the row, the second half with the column (each at inv frequencies
    theta^(-2k / (head_dim / 2)))."""
    quarter = head_dim // 4
    inv = 1.0 / (theta ** (torch.arange(0, quarter, dtype=torch.float32) * 2 / (head_dim // 2)))
    rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32),
                                indexing="ij")
    angles = torch.cat([torch.outer(rows.flatten(), inv), torch.outer(cols.flatten(), inv)], dim=1)
    return torch.polar(torch.ones_like(angles), angles)


class EncoderAttention(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.head_dim = v.head_dim
        self.wq = nn.Linear(v.hidden, v.hidden, bias=v.qkv_bias)
        self.wk = nn.Linear(v.hidden, v.hidden, bias=v.qkv_bias)
        self.wv = nn.Linear(v.hidden, v.hidden, bias=v.qkv_bias)
        self.wo = nn.Linear(v.hidden, v.hidden, bias=v.linear_bias)
        if v.qk_norm:  # InternViT: over the whole query / key vector (all heads), not per head
            self.q_norm = _norm(v.norm, v.hidden, v.norm_eps)
            self.k_norm = _norm(v.norm, v.hidden, v.norm_eps)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        heads = q.shape[-1] // self.head_dim  # this rank's (a tensor-parallel shard holds fewer)
        q, k = q.view(b, s, heads, self.head_dim), k.view(b, s, heads, self.head_dim)
        v = self.wv(x).view(b, s, heads, self.head_dim)  # named: an empty batch (a pass with no image) has no -1
        if freqs is not None:
            q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=False)
        return self.wo(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class EncoderMLP(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.act = v.act
        self.w1 = nn.Linear(v.hidden, v.ffn_hidden, bias=v.linear_bias)
        self.w2 = nn.Linear(v.ffn_hidden, v.hidden, bias=v.linear_bias)
        if v.act == "swiglu":
            self.w3 = nn.Linear(v.hidden, v.ffn_hidden, bias=v.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(_activation(self.act, self.w1(x)))


class EncoderBlock(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.attention_norm = _norm(v.norm, v.hidden, v.norm_eps)
        self.attention = EncoderAttention(v)
        self.ffn_norm = _norm(v.norm, v.hidden, v.norm_eps)
        self.feed_forward = EncoderMLP(v)
        if v.layer_scale:
            self.attention_scale = nn.Parameter(torch.empty(v.hidden))
            self.ffn_scale = nn.Parameter(torch.empty(v.hidden))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attention(self.attention_norm(x), freqs)
        a = a * self.attention_scale if hasattr(self, "attention_scale") else a
        x = x + a
        m = self.feed_forward(self.ffn_norm(x))
        return x + (m * self.ffn_scale if hasattr(self, "ffn_scale") else m)


class VisionEncoder(nn.Module):
    """The ViT of a `VLMConfig`: (N, C, H, W) -> (N, encoder tokens, hidden) after the blocks it runs."""

    def __init__(self, config):
        super().__init__()
        v = config.vision
        self.v = v
        self.patch_embed = nn.Linear(v.patch_dim, v.hidden, bias=v.linear_bias)
        if v.class_token:
            self.class_embedding = nn.Parameter(torch.empty(1, v.hidden))
        if v.position == "learned":
            self.pos_embeddings = nn.Embedding(v.seq_len, v.hidden)
        else:
            self.register_buffer("freqs", rope2d_frequencies(v.head_dim, v.grid), persistent=False)
        if v.family == "clip":
            self.pre_norm = _norm(v.norm, v.hidden, v.norm_eps)
        self.layers = nn.ModuleDict({str(i): EncoderBlock(v) for i in range(config.encoder_layers_run)})

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        check_images(images, self.v)
        patches = patchify(images.to(self.patch_embed.weight.dtype), self.v.patch_size)
        if self.v.temporal_patch_size > 1:  # a still image repeated over the patch's frames
            n, p, d = patches.shape
            patches = patches.view(n, p, self.v.channels, 1, -1).expand(-1, -1, -1, self.v.temporal_patch_size, -1)
            patches = patches.reshape(n, p, -1)
        x = self.patch_embed(patches)
        if self.v.class_token:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1).to(x.dtype), x], dim=1)
        freqs = None
        if self.v.position == "learned":
            x = x + self.pos_embeddings.weight[None].to(x.dtype)
        else:
            freqs = self.freqs
            if self.v.class_token:  # the class token sits at position (0, 0) with no rotation
                freqs = torch.cat([torch.ones_like(freqs[:1]), freqs])
        if hasattr(self, "pre_norm"):
            x = self.pre_norm(x)
        for block in self.layers.values():
            x = block(x, freqs)
        return x


class Projector(nn.Module):
    """Encoder features (N, tokens, d_enc) to LLM image tokens (N, image_tokens, d_llm)."""

    def __init__(self, config):
        super().__init__()
        p, self.merge, self.grid = config.projector, config.projector.merge, config.vision.grid
        self.act, self.layers = p.act, p.layers
        self.drop_class = config.vision.class_token and config.feature_select == "default"
        if p.norm:
            self.norm = _norm(config.vision.norm, config.projector_in, config.vision.norm_eps)
        out = config.llm.hidden
        self.w1 = nn.Linear(config.projector_in, config.projector_hidden if p.layers == 2 else out, bias=p.bias)
        if p.layers == 2:
            self.w2 = nn.Linear(config.projector_hidden, out, bias=p.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_class:
            x = x[:, 1:]
        if self.merge > 1:  # m x m neighbouring patches side by side, blocks row-major
            n, _, d = x.shape
            g, m = self.grid, self.merge
            x = x.reshape(n, g // m, m, g // m, m, d).permute(0, 1, 3, 2, 4, 5).reshape(n, (g // m) ** 2, m * m * d)
        if hasattr(self, "norm"):
            x = self.norm(x)
        x = self.w1(x)
        if self.layers == 2:
            x = self.w2(_activation(self.act, x))
        return x


class ImageEncoder(nn.Module):
    """Encoder + projector: the part of a VLM that runs per image, (N, C, H, W) -> (N, image_tokens, d_llm).
    Parameter names as in `VisionLanguageModel` (`vision.*`, `projector.*`)."""

    def __init__(self, config):
        super().__init__()
        self.vision = VisionEncoder(config)
        self.projector = Projector(config)

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
    (identity in one process; a parallel chunk's block of its data block otherwise). Left set
    until the backward is done: a recomputed embedding splices again."""

    def __init__(self, image_token_id: int, take=None):
        self.image_token_id = image_token_id
        self.take = take or (lambda x: x)
        self.images: torch.Tensor | None = None
        # (B, S) bool: the caller's placeholder positions, set with `images` when the embedding's
        # output is not in its input's layout (a sequence-parallel vocabulary-parallel embedding
        # reduce-scatters the sequence): the mask is then `take` of it, like the images.
        self.placeholders: torch.Tensor | None = None

    def __call__(self, module, args, output):
        if self.images is None:
            return output
        if self.placeholders is not None:
            mask = self.take(self.placeholders)[..., None]
            return torch.where(mask, self.take(self.images).to(output.dtype), output)
        tokens = args[0].to_local() if hasattr(args[0], "to_local") else args[0]  # a TP embedding's input
        return splice_images(output, tokens, self.take(self.images), self.image_token_id)


class VisionLanguageModel(nn.Module):
    """Encoder + projector + decoder LLM in one process (the reference the runtime is tested against).

    `forward(tokens (B, S), images (N, C, H, W))` -> logits (B, S, vocab). Submodules `vision`,
    `projector` (as in `ImageEncoder`) and `llm` (a `Transformer`)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vision = VisionEncoder(config)
        self.projector = Projector(config)
        self.llm = Transformer(config.llm)
        self.splice = ImageSplice(image_token_id(config))
        self.llm.tok_embeddings.register_forward_hook(self.splice)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision(images))

    def forward(self, tokens: torch.Tensor, images: torch.Tensor | None,
                positions: torch.Tensor | None = None, doc_ids=None) -> torch.Tensor:
        self.splice.images = None
        if images is not None and images.shape[0]:
            self.splice.images = scatter_images(tokens, self.encode(images), self.splice.image_token_id)
        return self.llm(tokens, positions, doc_ids)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        self.llm.init_weights(seed, std)
        for name, p in self.named_parameters():
            if not name.startswith(LLM_PREFIX):
                p.copy_(init_value(name, p.shape, seed, self.config, std))


def init_value(name: str, shape, seed: int, config, std: float = 0.02, offset=None, piece_shape=None) -> torch.Tensor:
    """The initial value of VLM parameter `name` (or of its rectangle at `offset`), see the module
    docstring."""
    if name.startswith(LLM_PREFIX):
        return init_piece(name.removeprefix(LLM_PREFIX), shape, seed, config.llm.num_layers, std, offset, piece_shape)
    if name.endswith("_scale"):
        return torch.full(tuple(piece_shape or shape), LAYER_SCALE_INIT)
    depth = config.encoder_layers_run if name.startswith(VISION_PREFIX) else 1
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
        return ImageEncoder(config)


def vision_frequencies(module: nn.Module, config) -> None:
    """Recompute the rotary table of a materialised encoder (buffers are not parameters)."""
    v = config.vision
    for m in module.modules():
        if isinstance(m, VisionEncoder) and "freqs" in m._buffers:
            m.freqs = rope2d_frequencies(v.head_dim, v.grid).to(m.patch_embed.weight.device)


__all__ = ["VisionLanguageModel", "ImageEncoder", "build_vlm", "build_image_encoder", "image_token_id",
           "scatter_images", "splice_images", "ImageSplice", "init_value"]
