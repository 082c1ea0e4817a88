"""CLIPViTModel: a ViT image encoder (CLIP-style with a class token and pre-norm; SigLIP-style without).

Pixels [n, 3, H, W] -> patch embedding (a strided conv) -> (+ class token) + learned position embeddings
-> the text models' TransformerBlock with a non-causal layer spec -> features [n, s, h] (batch-first, as
Megatron returns them). Parameter names follow Megatron: ``conv1``, ``class_token``,
``position_embeddings``, ``ln_pre`` / ``ln_post``, ``decoder.layers.N...``.
"""
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.common.vision_module.vision_module import VisionModule
from megatron.core.process_groups_config import ProcessGroupCollection, get_pg_size
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import get_device

SUBTYPES = ("clip", "siglip")


class _WholeEncoderStage:
    """The pipeline coordinates of an encoder that lives whole on one stage (rank 0 of 1), whatever the
    language model's pipeline: its block then builds every layer, numbered from 1."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def encoder_process_groups(pg_collection=None):
    """Process groups for an encoder kept whole on the first pipeline stage: the TP (and CP) groups of
    ``pg_collection`` or parallel_state, and a one-stage pipeline. None (parallel_state's groups) when
    the run has no pipeline to step around."""
    if get_pg_size(pg_collection, "pp", "CLIPViTModel") == 1:
        return pg_collection
    if pg_collection is None:
        return ProcessGroupCollection(tp=parallel_state.get_tensor_model_parallel_group(),
                                      cp=parallel_state.get_context_parallel_group(), pp=_WholeEncoderStage())
    return ProcessGroupCollection(tp=pg_collection.tp, cp=pg_collection.cp, pp=_WholeEncoderStage())


def interpolate_position_embeddings(table: torch.Tensor, grid: tuple, new_grid: tuple, num_prefix: int):
    """Position table [num_prefix + gh*gw, h] for a (gh, gw) patch grid -> the table for ``new_grid``,
    resizing the patch part as a 2-D image (bicubic, as HF's ``interpolate_pos_encoding``)."""
    if tuple(grid) == tuple(new_grid):
        return table
    prefix, patches = table[:num_prefix], table[num_prefix:]
    h = table.size(-1)
    patches = patches.reshape(1, grid[0], grid[1], h).permute(0, 3, 1, 2)  # [1, h, gh, gw]
    patches = F.interpolate(patches.float(), size=tuple(new_grid), mode="bicubic", align_corners=False)
    patches = patches.to(table.dtype).permute(0, 2, 3, 1).reshape(-1, h)  # [gh' * gw', h]
    return torch.cat([prefix, patches], dim=0)


class CLIPViTModel(VisionModule):
    """ViT encoder. ``model_subtype``: "clip" (class token, ``ln_pre`` before the layers, conv without
    bias) or "siglip" (no class token, ``ln_post`` after the layers, conv with bias). Images of another
    size than (img_h, img_w) use the position table interpolated to their patch grid.
    ``pg_collection``: explicit groups (its ``tp`` splits heads and MLP like the text transformer)."""

    def __init__(self, transformer_config, transformer_layer_spec: ModuleSpec,
                 ln_pre_impl: Union[ModuleSpec, type] = WrappedTorchNorm,
                 ln_post_impl: Union[ModuleSpec, type] = WrappedTorchNorm, add_class_token: bool = True,
                 class_token_len: int = 1, patch_dim: int = 14, img_h: int = 336, img_w: int = 336,
                 model_subtype: str = "clip", pg_collection=None, vp_stage: Optional[int] = None,
                 num_channels: int = 3) -> None:
        super().__init__(config=transformer_config)
        if model_subtype not in SUBTYPES:
            raise ValueError(f"CLIPViTModel: model_subtype '{model_subtype}' is not supported; use one of {SUBTYPES}")
        if model_subtype == "siglip" and (add_class_token or class_token_len):
            raise ValueError("CLIPViTModel: SigLIP has no class token; pass add_class_token=False, class_token_len=0")
        if img_h % patch_dim or img_w % patch_dim:
            raise ValueError(f"image size {img_h}x{img_w} is not a multiple of the patch size {patch_dim} "
                             "(--img-h / --img-w / --patch-dim)")
        if transformer_config.sequence_parallel or transformer_config.context_parallel_size > 1:
            raise ValueError("CLIPViTModel: sequence or context parallelism in the vision encoder is not supported; "
                             "give the vision config sequence_parallel=False and context_parallel_size=1")
        self.model_subtype, self.patch_dim, self.img_h, self.img_w = model_subtype, patch_dim, img_h, img_w
        self.visual_hidden_size = transformer_config.hidden_size
        self.add_class_token = add_class_token
        self.class_token_len = class_token_len if add_class_token else 0
        self.grid = (img_h // patch_dim, img_w // patch_dim)
        self.num_patches = self.grid[0] * self.grid[1]
        self.seq_length = self.num_patches + self.class_token_len
        self.pg_collection = encoder_process_groups(pg_collection)
        self.vp_stage = vp_stage
        device = torch.device("cpu") if transformer_config.use_cpu_initialization else get_device()
        dtype = transformer_config.params_dtype
        init = transformer_config.init_method

        self.conv1 = torch.nn.Conv2d(num_channels, self.visual_hidden_size, kernel_size=patch_dim, stride=patch_dim,
                                     bias=model_subtype == "siglip", device=device, dtype=dtype)
        self.conv1.weight.init_fn = init
        if self.conv1.bias is not None:
            self.conv1.bias.init_fn = torch.nn.init.zeros_
        self.position_embeddings = torch.nn.Embedding(self.seq_length, self.visual_hidden_size, device=device,
                                                      dtype=dtype)
        self.position_embeddings.weight.init_fn = init
        if add_class_token:
            self.class_token = torch.nn.Parameter(
                torch.empty(1, self.class_token_len, self.visual_hidden_size, device=device, dtype=dtype))
            self.class_token.init_fn = init
        norm_kwargs = dict(config=transformer_config, hidden_size=self.visual_hidden_size,
                           eps=transformer_config.layernorm_epsilon)
        self.ln_pre = build_module(ln_pre_impl, **norm_kwargs) if model_subtype == "clip" else None
        self.ln_post = build_module(ln_post_impl, **norm_kwargs) if model_subtype == "siglip" else None
        # No final norm inside the block (post_process=False): CLIP's features are taken before it.
        self.decoder = TransformerBlock(transformer_config, transformer_layer_spec, pre_process=True,
                                        post_process=False, pg_collection=self.pg_collection, vp_stage=vp_stage)
        self.finalize_parameters()

    def set_input_tensor(self, input_tensor) -> None:
        self.decoder.set_input_tensor(input_tensor)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Pixels [n, c, H, W] -> patch (+ class) embeddings with positions [n, s, h]."""
        if x.shape[-2] % self.patch_dim or x.shape[-1] % self.patch_dim:
            raise ValueError(f"image of {x.shape[-2]}x{x.shape[-1]} px is not a multiple of the patch size "
                             f"{self.patch_dim}")
        x = self.conv1(x.to(self.conv1.weight.dtype))  # [n, h, gh, gw]
        grid = tuple(x.shape[-2:])
        x = x.flatten(2).transpose(1, 2)  # [n, gh * gw, h]
        if self.add_class_token:
            x = torch.cat([self.class_token.expand(x.size(0), -1, -1), x], dim=1)  # [n, cls + gh * gw, h]
        table = interpolate_position_embeddings(self.position_embeddings.weight, self.grid, grid,
                                                self.class_token_len)
        return x + table.unsqueeze(0)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Images [n, c, H, W] -> features [n, s, h] (s = class tokens + patches)."""
        x = self.embed(x)
        if self.ln_pre is not None:
            x = self.ln_pre(x)
        x = x.transpose(0, 1).contiguous()  # [s, n, h]
        x = self.decoder(x, attention_mask)
        x = x.transpose(0, 1).contiguous()  # [n, s, h]
        if self.ln_post is not None:
            x = self.ln_post(x)
        return x


def get_num_image_embeddings(img_h: int, img_w: int, patch_dim: int, vision_model_type: str,
                             disable_vision_class_token: bool, class_token_len: int, pixel_shuffle: bool = False,
                             use_tile_tags: bool = False, max_num_tiles: int = 0, tokenizer_type=None) -> int:
    """Language-model positions one image tile takes: its patches plus the class token(s) that are kept."""
    if pixel_shuffle or use_tile_tags:
        raise NotImplementedError("pixel shuffle and tile tags are not supported")
    if vision_model_type not in SUBTYPES:
        raise ValueError(f"--vision-model-type '{vision_model_type}' is not supported; use one of {SUBTYPES}")
    keep_class = vision_model_type == "clip" and not disable_vision_class_token
    return (img_h // patch_dim) * (img_w // patch_dim) + (class_token_len if keep_class else 0)
