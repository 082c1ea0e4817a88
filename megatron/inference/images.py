"""Images with prompts for a vision-language model: decoding, tiling, and the ``<image>`` tags of the text.

A prompt marks each image with the tag ``<image>`` (as the training data does); its images, in tag order,
follow the prompts' order. A single prompt without tags gets its images first. Each tag becomes one
``image_token_index`` in the tokens; the engine expands it to the image's feature positions.
"""
import base64
import binascii
import io
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.training.datasets.image_processing import process_image
from megatron.training.datasets.vlm_dataset import IMAGE_TAG


@dataclass
class ImageConfig:
    """How images become ViT tiles (pretrain_vlm.py's flags: --img-h, --img-w, --vision-model-type, tiling)."""
    img_h: int
    img_w: int
    image_token_index: int
    vision_model_type: str = "clip"
    use_tiling: bool = False
    max_num_tiles: int = 1
    use_thumbnail: bool = False

    @classmethod
    def from_args(cls, args) -> "ImageConfig":
        return cls(args.img_h, args.img_w, args.image_token_index, args.vision_model_type, args.use_tiling,
                   args.max_num_tiles, args.use_thumbnail)


@dataclass
class PromptImages:
    """One prompt's images: tiles [n, 3, img_h, img_w] of all its images in order, and tiles per image."""
    tiles: torch.Tensor
    num_image_tiles: List[int]


def image_tiles(source, config: ImageConfig, name: str) -> torch.Tensor:
    """An image file path or bytes -> tiles [n, 3, img_h, img_w]; ValueError naming ``name`` if unreadable."""
    from PIL import Image  # lazy: Pillow is needed only when a request carries images

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            image.load()
            return process_image(image, config.img_h, config.img_w, config.vision_model_type, config.use_tiling,
                                 config.max_num_tiles, config.use_thumbnail)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{name} cannot be read as an image ({reason})") from None


def decode_base64(text, name: str) -> bytes:
    """A base64 string (optionally a ``data:image/...;base64,`` URL) -> bytes; ValueError naming ``name``."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a base64 string")
    if text.startswith("data:"):
        text = text.split(",", 1)[-1]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} is not valid base64") from None


def assign_images(prompts: List[str], images: Sequence[torch.Tensor]) -> Tuple[List[str], List[Optional[PromptImages]]]:
    """Give each prompt the images of its ``<image>`` tags (in order over all prompts); a single prompt
    without tags gets every image, tagged first. Returns the prompts (tags added) and each one's images."""
    tags = [p.count(IMAGE_TAG) for p in prompts]
    if images and sum(tags) == 0 and len(prompts) == 1:
        prompts, tags = ["".join([IMAGE_TAG] * len(images)) + prompts[0]], [len(images)]
    return prompts, group_images(tags, images, f"{IMAGE_TAG} tag(s)")


def group_images(counts: List[int], images: Sequence[torch.Tensor], what: str) -> List[Optional[PromptImages]]:
    """Split ``images`` (tiles of each image) over prompts holding ``counts`` images each, in order."""
    if sum(counts) != len(images):
        raise ValueError(f"the prompts have {sum(counts)} {what} for {len(images)} image(s); "
                         f"put one {IMAGE_TAG} per image in the prompt")
    out, i = [], 0
    for n in counts:
        mine = list(images[i:i + n])
        i += n
        out.append(PromptImages(torch.cat(mine), [t.shape[0] for t in mine]) if mine else None)
    return out


def tokenize_with_images(tokenizer, text: str, image_token_index: int, add_bos: bool) -> List[int]:
    """Token ids of ``text`` with one ``image_token_index`` per ``<image>`` tag (the text around each tag
    is tokenized on its own, as the training data path does)."""
    ids = [tokenizer.bos] if add_bos else []
    for i, piece in enumerate(text.split(IMAGE_TAG)):
        if i:
            ids.append(image_token_index)
        if piece.strip():
            ids += [int(t) for t in tokenizer.tokenize(piece)]
    return ids


def token_strings(tokenizer, ids: Sequence[int], image_token_index: Optional[int]) -> List[str]:
    """Each token's text; an image token is ``<image>``."""
    return [IMAGE_TAG if t == image_token_index else tokenizer.detokenize([t]) for t in ids]


def detokenize_with_images(tokenizer, ids: Sequence[int], image_token_index: int) -> str:
    """Text of ``ids``: each run of text tokens detokenized together, each image token as ``<image>``."""
    out, run = [], []
    for t in list(ids) + [None]:
        if t is None or t == image_token_index:
            if run:
                out.append(tokenizer.detokenize(run))
                run = []
            if t is not None:
                out.append(IMAGE_TAG)
        else:
            run.append(t)
    return "".join(out)
