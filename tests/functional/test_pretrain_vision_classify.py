"""pretrain_vision_classify.py end to end on CPU: a tiny ViT classifier trains on a tiny generated image folder
(3 classes told apart by colour; loss falls, accuracy is logged and rises, validation on a second folder);
a truncated image stops the run with one line naming the file, or is skipped with --skip-bad-samples;
a path that is not an image folder fails in one line."""
import re

import numpy as np
import pytest

from tests.functional.cli_runner import CliRunner

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --img-h 16 --img-w 16 --patch-dim 4 "
         "--num-classes 3 --micro-batch-size 6 --global-batch-size 12 --lr 1e-2 --log-interval 1 --seed 1 "
         "--num-workers 1 --hidden-dropout 0 --attention-dropout 0 --eval-iters 0").split()
# The log line leaves out a zero average (Megatron's), so accuracy may be absent at first.
LINE = re.compile(r"iteration\s+\d+/\s*\d+ .*\| loss: ([0-9.E+-]+) \|(?: accuracy: ([0-9.E+-]+) \|)?")
COLOURS = [(220, 40, 40), (40, 200, 60), (50, 60, 230)]


def write_image_folder(root, per_class, seed):
    """root/class_k/img_i.png: noisy images of colour k, of varied sizes."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for k, colour in enumerate(COLOURS):
        folder = root / f"class_{k}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            h, w = rng.integers(16, 28, size=2)
            pixels = np.clip(np.array(colour) + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"img_{i}.png")
    return str(root)


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagefolder")
    train = write_image_folder(root / "train", 8, seed=0)
    valid = write_image_folder(root / "valid", 2, seed=1)
    broken = write_image_folder(root / "broken", 2, seed=2)
    (root / "broken" / "class_1" / "img_0.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return dict(root=root, train=train, valid=valid, broken=broken)


def _run(cli, extra, nranks=1):
    return cli.run(["pretrain_vision_classify.py"] + MODEL + [str(a) for a in extra], nranks=nranks, timeout=300)


def test_trains_loss_falls_and_accuracy_is_logged(cli, data):
    (run,) = _run(cli, ["--data-path", data["train"], data["valid"], "--train-iters", "16", "--eval-iters", "1",
                        "--eval-interval", "16"])
    assert run.rc == 0, run.out[-2000:] + run.err[-2000:]
    rows = [(float(loss), float(acc or 0)) for loss, acc in LINE.findall(run.out)]
    assert len(rows) == 16, run.out[-2000:]
    losses, accuracy = [r[0] for r in rows], [r[1] for r in rows]
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4]), losses
    assert all(0.0 <= a <= 1.0 for a in accuracy) and sum(accuracy[-4:]) > sum(accuracy[:4]), accuracy
    assert "validation loss at iteration 16" in run.out and "accuracy value" in run.out


def test_tp2_runs(cli, data):
    runs = _run(cli, ["--data-path", data["train"], "--train-iters", "2", "--tensor-model-parallel-size", "2"],
                nranks=2)
    assert all(r.rc == 0 for r in runs), runs[0].err[-2000:] + runs[1].err[-2000:]
    assert len(LINE.findall(runs[-1].out)) == 2


def test_bad_image_stops_with_one_line_or_is_skipped(cli, data):
    args = ["--data-path", data["broken"], "--train-iters", "2", "--micro-batch-size", "6", "--global-batch-size", "6"]
    (run,) = _run(cli, args)
    assert run.rc != 0
    lines = [ln for ln in (run.out + run.err).splitlines() if ln.startswith("[rank 0]")]
    assert lines and re.search(r"class_1/img_0\.png: image cannot be read", lines[-1]), lines
    (run,) = _run(cli, args + ["--skip-bad-samples"])
    assert run.rc == 0, run.err[-2000:]
    assert "skipping" in run.err + run.out and "class_1/img_0.png" in run.err + run.out


def test_not_an_image_folder(cli, data):
    (run,) = _run(cli, ["--data-path", str(data["root"] / "nowhere"), "--train-iters", "1"])
    assert run.rc != 0 and "nowhere: no such folder" in run.out + run.err
    (run,) = _run(cli, ["--data-path", data["train"], "--train-iters", "1", "--vision-backbone-type", "swin"])
    assert run.rc != 0 and "--vision-backbone-type swin: only vit is built here" in run.out + run.err
