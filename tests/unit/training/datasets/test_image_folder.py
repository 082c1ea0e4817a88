"""Image-folder data of pretrain_vision_classify.py: class ids from sorted folders, Megatron's fractions,
reproducible augmentation per (seed, epoch, index), evaluation centre crops, bad images in one line or skipped."""
import numpy as np
import pytest
import torch
from PIL import Image

from megatron.training.datasets.image_folder import ImageFolderDataset, find_samples
from megatron.training.datasets.vlm_dataset import BadSample


@pytest.fixture()
def folder(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("b_dog", "a_cat", "c_eel", "d_owl"):
        (tmp_path / name).mkdir()
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (20 + i, 30, 3), dtype=np.uint8)).save(tmp_path / name / f"{i}.png")
    (tmp_path / "a_cat" / "notes.txt").write_text("not an image")
    return tmp_path


def test_classes_and_fractions(folder):
    classes, samples = find_samples(str(folder))
    assert classes == ["a_cat", "b_dog", "c_eel", "d_owl"] and len(samples) == 16
    assert samples[0] == (str(folder / "a_cat" / "0.png"), 0) and samples[-1][1] == 3
    classes, samples = find_samples(str(folder), classes_fraction=0.5, data_per_class_fraction=0.5)
    assert classes == ["a_cat", "b_dog"] and [label for _, label in samples] == [0, 0, 1, 1]


def test_augmentation_is_reproducible_and_eval_is_a_centre_crop(folder):
    train = ImageFolderDataset(str(folder), 16, 16, train=True, seed=3, num_samples=32)
    a, b = train[5], ImageFolderDataset(str(folder), 16, 16, train=True, seed=3)[5]
    assert a["images"].shape == (3, 16, 16) and int(a["labels"]) == 1
    torch.testing.assert_close(a["images"], b["images"])  # same (seed, epoch, index): same crop
    assert not torch.equal(train[5]["images"], train[21]["images"])  # the next epoch draws anew
    val = ImageFolderDataset(str(folder), 16, 16, train=False)
    torch.testing.assert_close(val[5]["images"], val[5]["images"])
    assert val[5]["images"].shape == (3, 16, 16)


def test_bad_image_and_bad_folders(folder, tmp_path_factory):
    (folder / "b_dog" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    ds = ImageFolderDataset(str(folder), 8, 8, train=True)
    with pytest.raises(BadSample, match=r"b_dog/0\.png: image cannot be read"):
        ds[4]
    skipping = ImageFolderDataset(str(folder), 8, 8, train=True, skip_bad_samples=True)
    assert int(skipping[4]["labels"]) == 1  # the next readable file (b_dog/1.png)
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(ValueError, match="no class sub-folders"):
        find_samples(str(empty))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        find_samples(str(empty / "missing"))
