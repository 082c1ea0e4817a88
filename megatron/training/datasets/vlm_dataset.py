"""Image-text samples for pretrain_vlm.py from a JSONL file and a folder of images (no Energon needed).

One JSON object per line, LLaVA's formats:
    {"image": "cat.png", "caption": "a cat on a mat"}                       captioning: loss on the caption
    {"image": ["a.png", "b.png"], "conversations": [{"from": "human", "value": "<image> <image> Same?"},
                                                   {"from": "gpt", "value": "No."}]}   loss on gpt turns
Image paths are relative to the JSONL's folder (or absolute). A caption without ``<image>`` gets the image
first. Each ``<image>`` becomes one ``image_token_index`` in the tokens; the model expands it to the image's
tile features. Samples are cut (or padded, loss-masked) to ``seq_length`` text tokens; an image whose token
was cut off is dropped with it.

Bad input (an unreadable or truncated image, a sample whose text does not hold one ``<image>`` per image, a
malformed line) raises one line naming the file and line, or with ``skip_bad_samples`` is reported once and
replaced by the next good sample.
"""
import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from .image_processing import process_image

logger = logging.getLogger(__name__)
IMAGE_TAG = "<image>"
_ROLES_WITH_LOSS = ("gpt", "assistant")


class BadSample(ValueError):
    """A sample that cannot be used; the message names its file and line."""


def worker_error_line(error: Exception) -> str:
    """The message a loader worker raised: DataLoader re-raises it with the worker's traceback prepended,
    whose last line is ``BadSample: <message>``."""
    lines = [ln for ln in str(error).splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return last.split("BadSample: ", 1)[1] if "BadSample: " in last else last


@dataclass
class VLMDataConfig:
    seq_length: int  # text tokens per sample
    img_h: int
    img_w: int
    image_token_index: int
    vision_model_type: str = "clip"
    use_tiling: bool = False
    max_num_tiles: int = 1
    use_thumbnail: bool = False
    skip_bad_samples: bool = False


def read_jsonl(path: str) -> List[str]:
    """The non-empty lines of ``path``; a missing file is one line naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data-path {path}: no such JSONL file (or pass an Energon dataset folder)")
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


class ImageTextJsonlDataset(torch.utils.data.Dataset):
    """Map-style dataset; ``__getitem__`` (run on DataLoader workers) reads, tiles and normalises images.
    ``first_line``: where ``lines`` start in the file (a --split part), for error messages."""

    first_line = 0

    def __init__(self, path: str, tokenizer, config: VLMDataConfig, num_samples: Optional[int] = None):
        self.path, self.tokenizer, self.config = path, tokenizer, config
        self.root = os.path.dirname(os.path.abspath(path))
        self.lines = read_jsonl(path)
        if not self.lines:
            raise ValueError(f"--data-path {path}: the file holds no samples")
        self.num_samples = num_samples or len(self.lines)
        self._reported = set()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        n = len(self.lines)
        for attempt in range(n):
            line = (index + attempt) % n
            try:
                return self.sample(line)
            except BadSample as e:
                if not self.config.skip_bad_samples:
                    raise
                if line not in self._reported:
                    self._reported.add(line)
                    logger.warning("skipping %s", e)
        raise ValueError(f"--data-path {self.path}: no readable sample (every line failed; see the warnings)")

    def sample(self, line: int) -> dict:
        """Tokens, labels, loss mask [seq_length] and the image tiles of line ``line`` (0-based)."""
        where = f"{self.path}:{self.first_line + line + 1}"
        try:
            record = json.loads(self.lines[line])
        except json.JSONDecodeError as e:
            raise BadSample(f"{where}: not valid JSON ({e.msg})") from None
        return encode_record(record, where, self._open, self.tokenizer, self.config)

    def _open(self, rel: str):
        return rel if os.path.isabs(rel) else os.path.join(self.root, rel)


def record_images(record: dict) -> List[str]:
    images = record.get("image", record.get("images", []))
    return [images] if isinstance(images, str) else list(images)


def encode_record(record: dict, where: str, open_image: Callable, tokenizer, config: VLMDataConfig) -> dict:
    """One sample's tensors from its JSON record; ``open_image(name)`` gives a path or file object for PIL.
    Shared by the JSONL and the Energon loaders."""
    images = record_images(record)
    turns = _turns(record, len(images), where)
    tokens, loss = _tokenize(turns, tokenizer, config.image_token_index)
    if sum(1 for t in tokens if t == config.image_token_index) != len(images):
        raise BadSample(f"{where}: the text has {turns_tag_count(turns)} {IMAGE_TAG} tags for "
                        f"{len(images)} image(s); put one {IMAGE_TAG} per image")
    # Inputs and next-token labels over seq_length + 1 tokens; images whose tag was cut off are dropped.
    seq = config.seq_length
    kept = sum(1 for t in tokens[:seq] if t == config.image_token_index)
    tiles = [_image(open_image(name), name, where, config) for name in images[:kept]]
    tokens, loss = tokens[:seq + 1], loss[:seq + 1]
    tokens += [tokenizer.eod] * (seq + 1 - len(tokens))
    loss += [0] * (seq + 1 - len(loss))
    t = torch.tensor(tokens, dtype=torch.long)
    empty = torch.zeros(0, 3, config.img_h, config.img_w)
    return {"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.tensor(loss[1:], dtype=torch.float),
            "images": torch.cat(tiles) if tiles else empty,
            "num_image_tiles": torch.tensor([x.size(0) for x in tiles], dtype=torch.long)}


def _turns(record: dict, n_images: int, where: str):
    """[(text, has_loss)] of a caption or conversation record."""
    if "conversations" in record:
        turns = [(str(t.get("value", "")), t.get("from") in _ROLES_WITH_LOSS) for t in record["conversations"]]
        if not any(loss for _, loss in turns):
            raise BadSample(f"{where}: the conversation has no gpt/assistant turn to learn from")
        return turns
    if "caption" in record or "text" in record:
        caption = str(record.get("caption", record.get("text")))
        prompt = "" if IMAGE_TAG in caption else " ".join([IMAGE_TAG] * n_images)
        return [(prompt, False), (caption, True)]
    raise BadSample(f"{where}: a sample needs 'caption' (or 'text') or 'conversations'")


def _tokenize(turns, tokenizer, image_token_index: int):
    """Token ids with the image token for each tag, and a 0/1 loss flag per token (it is a target; the
    labels shift it onto the position before)."""
    tokens, loss = [], []
    for text, has_loss in turns:
        for i, piece in enumerate(text.split(IMAGE_TAG)):
            if i:
                tokens.append(image_token_index)
                loss.append(0)
            if piece.strip():
                ids = tokenizer.tokenize(piece)
                tokens += ids
                loss += [int(has_loss)] * len(ids)
    tokens.append(tokenizer.eod)
    loss.append(loss[-1] if loss else 0)
    return tokens, loss


def _image(source, name: str, where: str, config: VLMDataConfig) -> torch.Tensor:
    from PIL import Image  # lazy: Pillow is needed only by the vision data path

    try:
        with Image.open(source) as image:
            image.load()
            return process_image(image, config.img_h, config.img_w, config.vision_model_type, config.use_tiling,
                                 config.max_num_tiles, config.use_thumbnail)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadSample(f"{where}: image {name} cannot be read ({reason})") from None


def turns_tag_count(turns) -> int:
    return sum(text.count(IMAGE_TAG) for text, _ in turns)


def collate_vlm(samples: List[dict]) -> dict:
    """Stack the fixed-size text tensors; concatenate every sample's image tiles and tile counts in order."""
    out = {k: torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask")}
    out["images"] = torch.cat([s["images"] for s in samples])
    out["num_image_tiles"] = torch.cat([s["num_image_tiles"] for s in samples])
    return out


ImageTextJsonlDataset.collate_fn = staticmethod(collate_vlm)
