"""Qwen25VLVisionModel: Qwen2.5-VL's native-resolution ViT (images keep their size; patches of 14 px).

Pixels arrive as flattened patches [N, c * t * p * p] (the Qwen2-VL image processor's ``pixel_values``,
patches of each 2x2 merge block consecutive) with one ``grid_thw`` row (temporal, height, width in
patches) per image. Patch embedding (a Conv3d over temporal patches, applied as the linear it equals)
-> 2-D rotary positions (height, width) -> the text models' layers (RMSNorm, SwiGLU MLP with biases),
window attention except in ``full_attention_layers`` -> final RMSNorm -> each 2x2 block of neighbouring
patches concatenated: features [N / 4, 4 * h], for the patch-merger projector.

Window attention: the patches are reordered so each window (``window_size`` px square, in merge blocks)
is contiguous (Hugging Face's ``window_index``), and attention is restricted to segments by a
block-diagonal mask (windows, or whole images for the full-attention layers); the output is put back in
patch order before the merge.
"""
from typing import Iterable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.models.common.vision_module.vision_module import VisionModule
from megatron.core.models.vision.clip_vit_model import encoder_process_groups
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import get_device


class _WindowedBlock(TransformerBlock):
    """A TransformerBlock whose ``attention_mask`` is a stack [2, ...]: mask 0 for the full-attention
    layers, mask 1 (windows) for the others."""

    def __init__(self, *args, full_attention_layers: Iterable[int] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.full_attention_layers = frozenset(full_attention_layers)

    def _layer_call(self, layer, hidden_states, attention_mask, rotary_pos_emb, **kwargs):
        mask = attention_mask[0 if layer.layer_number - 1 in self.full_attention_layers else 1]
        return super()._layer_call(layer, hidden_states, mask, rotary_pos_emb, **kwargs)


def vision_rotary_freqs(grid_thw: torch.Tensor, spatial_merge_size: int, head_dim: int,
                        theta: float = 10000.0) -> torch.Tensor:
    """2-D rotary angles [N, head_dim] in patch order: the first half of the rotated pairs turns with the
    patch row, the second with its column, each with frequencies theta^(-4j/head_dim) (half-dim RoPE)."""
    device = grid_thw.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device)
                                / (head_dim // 2)))  # [head_dim / 4]
    rows = []
    m = spatial_merge_size
    for t, h, w in grid_thw.tolist():
        hpos, wpos = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        # Patch order within an image: merge blocks row-major, each block's m x m patches row-major.
        hpos = hpos.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        wpos = wpos.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    pos = torch.cat(rows).float()  # [N, 2]
    freqs = torch.cat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], dim=-1)  # [N, head_dim / 2]
    return torch.cat([freqs, freqs], dim=-1)  # [N, head_dim], non-interleaved halves


def window_index(grid_thw: torch.Tensor, spatial_merge_size: int, window_size: int,
                 patch_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order [N / m^2], window_lens [windows]): the merge blocks of every image regrouped window by window
    (windows of ``window_size`` px, row-major; a window at the right or bottom edge may be smaller), and
    the number of patches in each window."""
    order, lens, offset = [], [], 0
    m = spatial_merge_size
    per_window = window_size // m // patch_size  # merge blocks along a window side
    if per_window < 1:
        raise ValueError(f"vision window size {window_size} px is smaller than one merge block "
                         f"({m} x {patch_size} px)")
    for t, h, w in grid_thw.tolist():
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = (-gh) % per_window, (-gw) % per_window
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // per_window, (gw + pad_w) // per_window
        padded = padded.reshape(t, nh, per_window, nw, per_window).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, per_window * per_window)  # [t, windows, blocks of a window]
        counts = (padded >= 0).sum(-1).flatten()
        flat = padded.flatten()
        order.append(flat[flat >= 0] + offset)
        lens.append(counts[counts > 0] * m * m)
        offset += t * gh * gw
    return torch.cat(order).to(grid_thw.device), torch.cat(lens).to(grid_thw.device)


def segment_mask(lengths: torch.Tensor) -> torch.Tensor:
    """[1, 1, S, S] bool, True = masked: position i sees position j when both lie in the same segment of
    ``lengths`` (consecutive segments covering the S positions)."""
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    return (ids[:, None] != ids[None, :])[None, None]


class Qwen25VLVisionModel(VisionModule):
    """Qwen2.5-VL's ViT. ``transformer_config``: its layers (RMSNorm, SwiGLU with biases, QKV bias, eps
    1e-6); the block's final norm is Hugging Face's ``merger.ln_q``. ``forward(pixels, grid_thw)`` returns
    merged features [N / m^2, h * m^2] in patch order (m = ``spatial_merge_size``).
    ``pg_collection``: explicit groups (its ``tp`` splits heads and MLP like the text transformer)."""

    def __init__(self, transformer_config, transformer_layer_spec: ModuleSpec, patch_dim: int = 14,
                 temporal_patch_size: int = 2, spatial_merge_size: int = 2, window_size: int = 112,
                 full_attention_layers: Iterable[int] = (7, 15, 23, 31), rotary_base: float = 10000.0,
                 num_channels: int = 3, pg_collection=None, vp_stage: Optional[int] = None) -> None:
        super().__init__(config=transformer_config)
        if transformer_config.sequence_parallel or transformer_config.context_parallel_size > 1:
            raise ValueError("Qwen25VLVisionModel: sequence or context parallelism in the vision encoder is not "
                             "supported; give the vision config sequence_parallel=False and context_parallel_size=1")
        layers = transformer_config.num_layers
        bad = [i for i in full_attention_layers if not 0 <= i < layers]
        if bad:
            raise ValueError(f"vision full-attention layers {bad} are outside the {layers} ViT layers "
                             "(--vision-full-attention-layers counts from 0)")
        self.patch_dim, self.temporal_patch_size = patch_dim, temporal_patch_size
        self.spatial_merge_size, self.window_size, self.rotary_base = spatial_merge_size, window_size, rotary_base
        self.num_channels = num_channels
        self.visual_hidden_size = transformer_config.hidden_size
        self.head_dim = transformer_config.kv_channels
        self.pg_collection = encoder_process_groups(pg_collection)
        self.vp_stage = vp_stage
        device = torch.device("cpu") if transformer_config.use_cpu_initialization else get_device()
        kernel = (temporal_patch_size, patch_dim, patch_dim)
        self.conv1 = torch.nn.Conv3d(num_channels, self.visual_hidden_size, kernel_size=kernel, stride=kernel,
                                     bias=False, device=device, dtype=transformer_config.params_dtype)
        self.conv1.weight.init_fn = transformer_config.init_method
        self.decoder = _WindowedBlock(transformer_config, transformer_layer_spec, pre_process=True, post_process=True,
                                      pg_collection=self.pg_collection, vp_stage=vp_stage,
                                      full_attention_layers=full_attention_layers)
        self.finalize_parameters()

    @property
    def patch_size_flat(self) -> int:
        """Values per flattened patch: channels x temporal patch x patch x patch."""
        return self.num_channels * self.temporal_patch_size * self.patch_dim ** 2

    def set_input_tensor(self, input_tensor) -> None:
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Patches [N, c*t*p*p], grid_thw [images, 3] -> merged features [N / m^2, h * m^2]."""
        grid_thw = torch.as_tensor(grid_thw, device=pixels.device).long().reshape(-1, 3)
        n, unit = pixels.shape[0], self.spatial_merge_size ** 2
        if pixels.dim() != 2 or pixels.shape[1] != self.patch_size_flat or n != int(grid_thw.prod(-1).sum()):
            raise ValueError(f"image patches of shape {tuple(pixels.shape)} do not match grid_thw "
                             f"{grid_thw.tolist()} (expected [{int(grid_thw.prod(-1).sum())}, {self.patch_size_flat}])")
        if bool((grid_thw[:, 1:] % self.spatial_merge_size).any()):
            raise ValueError(f"image grids {grid_thw.tolist()} are not multiples of the spatial merge size "
                             f"{self.spatial_merge_size}")
        weight = self.conv1.weight.reshape(self.visual_hidden_size, -1)
        x = F.linear(pixels.to(weight.dtype), weight)  # the stride = kernel Conv3d: [N, h]
        order, window_lens = window_index(grid_thw, self.spatial_merge_size, self.window_size, self.patch_dim)
        image_lens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])  # one per frame
        masks = torch.stack([segment_mask(image_lens), segment_mask(window_lens)])  # [2, 1, 1, N, N]

        def by_window(t):  # [N, ...] in patch order -> window order (whole merge blocks move)
            return t.reshape(n // unit, unit, *t.shape[1:])[order].reshape(t.shape)
        freqs = vision_rotary_freqs(grid_thw, self.spatial_merge_size, self.head_dim, self.rotary_base)
        rotary = by_window(freqs)[:, None, None, :]  # [N, 1, 1, d]
        x = by_window(x).unsqueeze(1)  # [N, 1, h]: one sequence of every image's patches
        x = self.decoder(x, masks, rotary_pos_emb=rotary).squeeze(1)  # [N, h]
        x = x.reshape(n // unit, unit, -1)[torch.argsort(order)]  # back to patch order: [N / m^2, m^2, h]
        return x.reshape(n // unit, unit * self.visual_hidden_size)
