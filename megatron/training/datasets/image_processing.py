"""Image -> normalised tile tensors for the ViT: resize, optional aspect-ratio tiling, normalisation.

Runs inside the DataLoader workers (a dataset's ``__getitem__`` calls it). Tiling follows Megatron's
examples/multimodal (InternVL's dynamic tiling): pick the grid of at most ``max_num_tiles`` tiles whose
aspect ratio is closest to the image's, resize to that grid, cut it into img_h x img_w tiles, and
optionally append the whole image resized as a thumbnail tile.
"""
from typing import List, Tuple

import numpy as np
import torch

# Normalisation of each --vision-model-type (CLIP's published pixel statistics; SigLIP maps to [-1, 1]).
PIXEL_STATS = {"clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
               "siglip": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}


def _to_tensor(image, mean, std) -> torch.Tensor:
    """PIL RGB image -> [3, H, W] float32, normalised."""
    x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def tile_grid(width: int, height: int, max_num_tiles: int) -> Tuple[int, int]:
    """(columns, rows) of at most ``max_num_tiles`` tiles whose ratio is closest to width / height; ties go
    to the grid with more tiles when the image has the pixels for it."""
    aspect = width / height
    grids = sorted({(c, r) for n in range(1, max_num_tiles + 1) for c in range(1, n + 1) for r in range(1, n + 1)
                    if c * r <= max_num_tiles}, key=lambda g: g[0] * g[1])
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and width * height > 0.5 * c * r * best[0] * best[1]:
            best = (c, r)
    return best


def process_image(image, img_h: int, img_w: int, vision_model_type: str = "clip", use_tiling: bool = False,
                  max_num_tiles: int = 1, use_thumbnail: bool = False) -> torch.Tensor:
    """A PIL image -> tiles [n, 3, img_h, img_w] (n = 1 without tiling)."""
    from PIL import Image  # lazy: Pillow is needed only by the vision data path

    mean, std = PIXEL_STATS[vision_model_type]
    image = image.convert("RGB")
    if not use_tiling or max_num_tiles <= 1:
        return _to_tensor(image.resize((img_w, img_h), Image.BICUBIC), mean, std).unsqueeze(0)
    cols, rows = tile_grid(image.width, image.height, max_num_tiles)
    resized = image.resize((cols * img_w, rows * img_h), Image.BICUBIC)
    tiles: List = [resized.crop((c * img_w, r * img_h, (c + 1) * img_w, (r + 1) * img_h))
                   for r in range(rows) for c in range(cols)]
    if use_thumbnail and len(tiles) > 1:
        tiles.append(image.resize((img_w, img_h), Image.BICUBIC))
    return torch.stack([_to_tensor(t, mean, std) for t in tiles])
