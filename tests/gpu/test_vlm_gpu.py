"""LLaVA on one GPU: the tiny model trains in bf16 on CUDA, and pretrain_vlm.py trains end to end from a
synthetic image-caption set (loss falls; the data-wait timer is logged). Skipped without CUDA.

The LLaVA-7B-shaped measurement (CLIP ViT-L/14-336 + a Llama-3-8B-shaped decoder cut to 8 layers) is
examples/multimodal/train_llava_7b.sh; see docs/multimodal.md for the command and what to read in its log."""
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from tests.fixtures.tiny_vlm import language_config, tiny_llava, vision_config, vlm_batch
from tests.gpu.benchmark_runs import failure_text

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_llava_trains_in_bf16_on_cuda():
    model_parallel_cuda_manual_seed(1234)
    language = language_config(use_cpu_initialization=False, bf16=True, params_dtype=torch.bfloat16)
    vision = vision_config(use_cpu_initialization=False, bf16=True, params_dtype=torch.bfloat16)
    model = Float16Module(language, tiny_llava(language, vision))
    p = next(model.parameters())
    assert p.is_cuda and p.dtype == torch.bfloat16
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = {k: v.cuda() for k, v in vlm_batch(0, batch=4).items()}
    losses = []
    for _ in range(12):
        out, mask = model(batch["images"], batch["tokens"], None, None, labels=batch["labels"],
                          loss_mask=batch["loss_mask"])
        loss = (out.float() * mask).sum() / mask.sum()
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_pretrain_vlm_on_gpu(tmp_path):
    from tests.fixtures.vlm_data import IMAGE_TOKEN, VOCAB, write_image_text_set
    data = write_image_text_set(str(tmp_path / "data"), n=64)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_vlm.py"),
           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--max-position-embeddings", "64", "--vocab-size", str(VOCAB), "--tokenizer-type", "NullTokenizer",
           "--image-token-index", str(IMAGE_TOKEN), "--img-h", "8", "--img-w", "8", "--patch-dim", "4",
           "--encoder-num-layers", "2", "--vision-hidden-size", "32", "--disable-vision-class-token",
           "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
           "--bf16", "--data-path", data, "--split", "90,10,0", "--micro-batch-size", "4",
           "--global-batch-size", "8", "--train-iters", "30", "--lr", "3e-3", "--log-interval", "1",
           "--eval-iters", "1", "--eval-interval", "30", "--num-workers", "2", "--timing-log-level", "2",
           "--seed", "1"]
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert p.returncode == 0, failure_text(p)
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+)", p.stdout)]
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5]), losses
    assert "batch-generator" in p.stdout + p.stderr
