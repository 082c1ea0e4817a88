"""pretrain_vlm.py end to end on CPU: a tiny LLaVA trains on a tiny image-caption set made in tmp (loss
falls), on the JSONL path and on an Energon dataset written by tools/prepare_vlm_energon.py, with TP=2 and
PP=2 on 2 gloo ranks; bad input stops with one line naming the file and line, or is skipped with
--skip-bad-samples."""
import os
import re

import pytest

from tests.fixtures.vlm_data import IMAGE_TOKEN, VOCAB, write_image_text_set
from tests.functional.cli_runner import CliRunner

MODEL = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 24 --max-position-embeddings 64 "
         f"--vocab-size {VOCAB} --tokenizer-type NullTokenizer --image-token-index {IMAGE_TOKEN} --img-h 8 --img-w 8 "
         "--patch-dim 4 --encoder-num-layers 2 --vision-hidden-size 24 --disable-vision-class-token "
         "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
         "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --log-interval 1 --num-workers 1 --seed 1 "
         "--hidden-dropout 0 --attention-dropout 0").split()
LOSS = re.compile(r"iteration\s+\d+/\s*\d+ .*\| lm loss: ([0-9.E+-]+)")


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    bad = [{"image": "broken.png", "caption": "1 2 3"}]
    good = write_image_text_set(str(root / "good"), n=24)
    broken = write_image_text_set(str(root / "broken"), n=8, extra=bad)
    (root / "broken" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return dict(root=root, good=good, broken=broken)


def _run(cli, extra, nranks=1):
    runs = cli.run(["pretrain_vlm.py"] + MODEL + [str(a) for a in extra], nranks=nranks, timeout=300)
    return runs


def _losses(out):
    return [float(x) for x in LOSS.findall(out)]


def test_trains_on_jsonl_and_loss_falls(cli, data):
    (run,) = _run(cli, ["--data-path", data["good"], "--split", "90,10,0", "--train-iters", "12",
                        "--eval-iters", "1", "--eval-interval", "12"])
    assert run.rc == 0, run.out[-2000:] + run.err[-2000:]
    losses = _losses(run.out)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), losses
    assert "validation loss at iteration 12" in run.out


def test_tp2_and_pp2_with_tiling_and_frozen_vit(cli, data):
    common = ["--data-path", data["good"], "--split", "100,0,0", "--train-iters", "3", "--eval-iters", "0",
              "--use-tiling", "--max-num-tiles", "2", "--use-thumbnail", "--seq-length", "40", "--freeze-ViT"]
    for layout in (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]):
        runs = _run(cli, common + layout, nranks=2)
        assert all(r.rc == 0 for r in runs), runs[0].out[-2000:] + runs[0].err[-2000:] + runs[1].err[-2000:]
        assert len(_losses(runs[-1].out)) == 3


def test_energon_dataset(cli, data):
    pytest.importorskip("megatron.energon")
    from tools.prepare_vlm_energon import prepare
    out = str(data["root"] / "energon")
    prepare(data["good"], out, (0.8, 0.2, 0.0), samples_per_shard=8)
    (run,) = _run(cli, ["--data-path", out, "--train-iters", "3", "--eval-iters", "1", "--eval-interval", "3"])
    assert run.rc == 0, run.out[-2000:] + run.err[-2000:]
    assert len(_losses(run.out)) == 3 and "validation loss at iteration 3" in run.out


def test_bad_image_stops_with_one_line_or_is_skipped(cli, data):
    args = ["--data-path", data["broken"], "--split", "100,0,0", "--train-iters", "3", "--eval-iters", "0",
            "--global-batch-size", "10", "--micro-batch-size", "10", "--num-workers", "1"]
    (run,) = _run(cli, args)
    assert run.rc != 0
    lines = [ln for ln in (run.out + run.err).splitlines() if ln.startswith("[rank 0]")]
    assert lines and re.search(r"train\.jsonl:9: image .*broken\.png cannot be read", lines[-1]), lines
    (run,) = _run(cli, args + ["--skip-bad-samples"])
    assert run.rc == 0 and "skipping" in run.err + run.out and "train.jsonl:9" in run.err + run.out


def test_folder_without_energon_metadata(cli, data):
    (run,) = _run(cli, ["--data-path", str(data["root"] / "good"), "--train-iters", "1", "--eval-iters", "0"])
    assert run.rc != 0
    assert "no Energon metadata (.nv-meta/)" in run.out + run.err
    assert os.path.isdir(data["root"] / "good")
