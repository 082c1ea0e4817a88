"""Multimodal RoPE position ids of a Qwen2-VL / Qwen2.5-VL token sequence (Hugging Face's ``get_rope_index``).

Text tokens count 0, 1, 2, ... on all three components (temporal, height, width). The features of an
image with an (h, w) merged grid sit at (start, start + row, start + column), start being the position
after the preceding text, and the text after it resumes at start + max(h, w). Generation continues each
row from its last position: position = token index + ``delta`` (the row's max position + 1 - its length).
"""
from typing import Optional, Tuple

import torch


def get_rope_index(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], image_token_index: int,
                   spatial_merge_size: int = 2, attention_mask: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [3, b, s], deltas [b, 1]) for ``input_ids`` [b, s] that hold t*h*w / merge^2 image
    tokens per image (``image_grid_thw`` [images, 3] in patches, in batch order). Positions where
    ``attention_mask`` [b, s] is 0 (padding) are skipped and get 0."""
    b, s = input_ids.shape
    device = input_ids.device
    position_ids = torch.zeros(3, b, s, dtype=torch.long, device=device)
    grids = [] if image_grid_thw is None else torch.as_tensor(image_grid_thw).reshape(-1, 3).tolist()
    images = iter(grids)
    deltas = []
    m = spatial_merge_size
    for row in range(b):
        keep = (attention_mask[row].bool() if attention_mask is not None
                else torch.ones(s, dtype=torch.bool, device=device))
        is_image = (input_ids[row][keep] == image_token_index).tolist()
        parts, pos, i = [], 0, 0
        while i < len(is_image):
            if not is_image[i]:  # a run of text
                j = i
                while j < len(is_image) and not is_image[j]:
                    j += 1
                parts.append(torch.arange(j - i, device=device).expand(3, -1) + pos)
                pos, i = pos + j - i, j
                continue
            grid = next(images, None)
            if grid is None:
                raise ValueError(f"sample {row} has more image tokens than the {len(grids)} image grid(s) cover")
            t, gh, gw = grid[0], grid[1] // m, grid[2] // m
            count = t * gh * gw
            if is_image[i:i + count] != [True] * count:
                raise ValueError(f"sample {row}: an image of grid {grid} needs {count} consecutive image tokens "
                                 f"({image_token_index}) from token {i}")
            tpos, hpos, wpos = torch.meshgrid(torch.arange(t, device=device), torch.arange(gh, device=device),
                                              torch.arange(gw, device=device), indexing="ij")
            parts.append(torch.stack([tpos, hpos, wpos]).reshape(3, -1) + pos)
            pos, i = pos + max(gh, gw), i + count
        positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long, device=device)
        position_ids[:, row, keep] = positions
        deltas.append((int(positions.max()) + 1 if positions.numel() else 0) - len(is_image))
    if next(images, None) is not None:
        raise ValueError(f"{len(grids)} image grid(s) for fewer images in the tokens; each image needs its "
                         f"{image_token_index} tokens")
    return position_ids, torch.tensor(deltas, device=device).unsqueeze(1)
