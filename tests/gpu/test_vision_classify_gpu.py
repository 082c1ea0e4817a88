"""ViT classification on one GPU: pretrain_vision_classify.py trains a small ViT in bf16 on a generated image
folder (loss falls, accuracy and the data-wait timer are logged), and tools/bench_vit.py runs its comparison
at a small size (timm's step too when timm is installed). Skipped without CUDA.

The ViT-L/16 measurement (images/s and MFU, ours next to timm's vit_large_patch16_224) is
    pip install timm && python tools/bench_vit.py            (see docs/multimodal.md)"""
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.functional.test_pretrain_vision_classify import LINE, write_image_folder
from tests.gpu.benchmark_runs import failure_text

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}


def test_pretrain_vision_classify_on_gpu_bf16(tmp_path):
    train = write_image_folder(tmp_path / "train", 32, seed=0)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_vision_classify.py"), "--num-layers", "4",
           "--hidden-size", "128", "--num-attention-heads", "4", "--img-h", "32", "--img-w", "32", "--patch-dim", "8",
           "--num-classes", "3", "--bf16", "--data-path", train, "--micro-batch-size", "16", "--global-batch-size",
           "32", "--train-iters", "40", "--lr", "3e-3", "--lr-warmup-iters", "4", "--log-interval", "1",
           "--eval-iters", "0", "--num-workers", "2", "--timing-log-level", "2", "--seed", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert p.returncode == 0, failure_text(p)
    rows = [(float(loss), float(acc or 0)) for loss, acc in LINE.findall(p.stdout)]
    assert len(rows) == 40
    losses = [r[0] for r in rows]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    assert sum(r[1] for r in rows[-5:]) / 5 > 0.8, rows[-5:]
    assert re.search(r"batch-generator", p.stdout), "the data-wait timer (batch-generator) is logged"


def test_bench_vit_small():
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_vit.py"), "--layers", "4", "--hidden", "256",
           "--heads", "4", "--ffn", "1024", "--batch", "16", "--steps", "5", "--warmup", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert p.returncode == 0, failure_text(p)
    assert re.search(r"^ours: [\d.]+ ms/step, [\d.]+ images/s, [\d.]+ TFLOP/s, MFU", p.stdout, re.M), p.stdout
    try:
        import timm  # noqa: F401
    except ImportError:
        assert "timm: not installed" in p.stdout
    else:
        assert re.search(r"^timm: [\d.]+ ms/step", p.stdout, re.M) and "ours / timm images/s" in p.stdout


def test_bench_vit_small_as_one_cuda_graph():
    """Our step replayed as one graph (as --cuda-graph-impl full_iteration) runs and trains: the replays
    must not skip the optimizer step (the bench asserts every step is taken)."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_vit.py"), "--layers", "4", "--hidden", "256",
           "--heads", "4", "--ffn", "1024", "--batch", "16", "--steps", "5", "--warmup", "4", "--impl", "ours",
           "--cuda-graph"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert p.returncode == 0, failure_text(p)
    assert "ours as one CUDA graph" in p.stdout
    assert re.search(r"^ours: [\d.]+ ms/step, [\d.]+ images/s", p.stdout, re.M), p.stdout
