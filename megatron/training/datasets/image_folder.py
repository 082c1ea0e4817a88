"""Image-classification samples from a folder with one sub-folder per class (torchvision's ImageFolder
layout, Megatron's legacy ``megatron/legacy/data/image_folder.py``):

    root/cat/001.jpg, root/cat/002.png, ..., root/dog/xyz.jpeg     class ids: sorted folder names, from 0

``--classes-fraction`` keeps the first part of the sorted classes, ``--data-per-class-fraction`` the first
part of each class's sorted files (Megatron's flags). Decoding and augmentation run in ``__getitem__`` on
the DataLoader workers: training crops a random area and aspect ratio and flips (RandomResizedCrop +
RandomHorizontalFlip), evaluation resizes and centre-crops; then ImageNet's normalisation. The random
draws come from (seed, epoch of the index, index), so a run is reproducible whatever the worker count.

An unreadable or truncated image raises one line naming the file, or with ``skip_bad_samples`` is reported
once and replaced by the next readable file.
"""
import logging
import math
import os
from typing import List, Tuple

import numpy as np
import torch

from .vlm_dataset import BadSample

logger = logging.getLogger(__name__)
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def find_samples(root: str, classes_fraction: float = 1.0,
                 data_per_class_fraction: float = 1.0) -> Tuple[List[str], List[Tuple[str, int]]]:
    """(class names, [(file, class id)]) of an image folder; one line naming ``root`` when it is unusable."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"--data-path {root}: no such folder (an image folder with one sub-folder per class)")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    classes = classes[:int(len(classes) * classes_fraction)]
    if not classes:
        raise ValueError(f"--data-path {root}: no class sub-folders (expected {root}/<class>/<image>)")
    samples = []
    for index, name in enumerate(classes):
        files = []
        for folder, _, names in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            files += [os.path.join(folder, f) for f in sorted(names) if f.lower().endswith(IMG_EXTENSIONS)]
        samples += [(f, index) for f in files[:int(len(files) * data_per_class_fraction)]]
    if not samples:
        raise ValueError(f"--data-path {root}: no images with extensions {', '.join(IMG_EXTENSIONS)}")
    return classes, samples


def _random_crop_box(width: int, height: int, g: torch.Generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """RandomResizedCrop's box (left, top, right, bottom): a random area fraction and log-uniform aspect
    ratio, ten tries, then the centre crop at the nearest allowed ratio."""
    area = width * height
    for _ in range(10):
        u = torch.rand(3, generator=g).tolist()
        target = area * (scale[0] + u[0] * (scale[1] - scale[0]))
        aspect = math.exp(math.log(ratio[0]) + u[1] * (math.log(ratio[1]) - math.log(ratio[0])))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(0, width - w + 1, (1,), generator=g))
            top = int(torch.randint(0, height - h + 1, (1,), generator=g))
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def transform_image(image, img_h: int, img_w: int, train: bool, g: torch.Generator) -> torch.Tensor:
    """A PIL image -> [3, img_h, img_w] float32, augmented (train) or resized + centre-cropped, normalised."""
    from PIL import Image  # lazy: Pillow is needed only by the vision data path

    image = image.convert("RGB")
    if train:
        image = image.resize((img_w, img_h), Image.BICUBIC, box=_random_crop_box(image.width, image.height, g))
        if float(torch.rand(1, generator=g)) < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
    else:  # shorter side to the target (as Resize(size)), then the centre
        s = max(img_h / image.height, img_w / image.width)
        w, h = max(img_w, round(image.width * s)), max(img_h, round(image.height * s))
        image = image.resize((w, h), Image.BICUBIC)
        left, top = (w - img_w) // 2, (h - img_h) // 2
        image = image.crop((left, top, left + img_w, top + img_h))
    x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)


class ImageFolderDataset(torch.utils.data.Dataset):
    """Map-style dataset of {"images": [3, img_h, img_w], "labels": class id}; ``num_samples`` > the folder's
    size repeats it (each repeat draws new augmentations)."""

    def __init__(self, root: str, img_h: int, img_w: int, train: bool, seed: int = 1234,
                 classes_fraction: float = 1.0, data_per_class_fraction: float = 1.0,
                 skip_bad_samples: bool = False, num_samples=None):
        self.root, self.img_h, self.img_w, self.train, self.seed = root, img_h, img_w, train, seed
        self.skip_bad_samples = skip_bad_samples
        self.classes, self.samples = find_samples(root, classes_fraction, data_per_class_fraction)
        self.num_samples = num_samples or len(self.samples)
        self._reported = set()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        n = len(self.samples)
        for attempt in range(n):
            i = (index + attempt) % n
            try:
                return self.sample(i, epoch=index // n)
            except BadSample as e:
                if not self.skip_bad_samples:
                    raise
                if i not in self._reported:
                    self._reported.add(i)
                    logger.warning("skipping %s", e)
        raise ValueError(f"--data-path {self.root}: no readable image (every file failed; see the warnings)")

    def sample(self, i: int, epoch: int = 0) -> dict:
        from PIL import Image  # lazy: Pillow is needed only by the vision data path

        path, label = self.samples[i]
        g = torch.Generator().manual_seed(hash((self.seed, epoch, i)) & ((1 << 63) - 1))
        try:
            with Image.open(path) as image:
                image.load()
                x = transform_image(image, self.img_h, self.img_w, self.train, g)
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BadSample(f"{path}: image cannot be read ({reason})") from None
        return {"images": x, "labels": torch.tensor(label, dtype=torch.long)}
