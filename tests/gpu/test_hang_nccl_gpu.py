"""Hang dump on two GPUs (NCCL): rank 1 freezes after iteration 1; both ranks write their stacks and last
collectives, and torch's NCCL flight recorder writes its trace for rank 0 at the timeout.
Needs two CUDA devices; skipped otherwise."""
import os

import pytest
import torch

from tests.functional.cli_runner import CliRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--micro-batch-size 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 128 --eval-iters 0 "
         "--mock-data --bf16 --log-interval 1").split()


def test_nccl_hang_dumps_stacks_and_flight_recorder(tmp_path):
    prefix = str(tmp_path / "hang_rank")
    with CliRunner(gpus=True) as cli:
        results = cli.run(["pretrain_gpt.py"] + MODEL + ["--train-iters", "200", "--flight-recorder-dump-path", prefix,
                                                          "--distributed-timeout-seconds-after-init", "20"],
                          nranks=2, timeout=240, stop_others=True,
                          pause=dict(rank=1, when_rank=1, when_text="iteration        1/", for_s=60))
    assert all(r.rc not in (0, "timeout") for r in results), [r.err[-2000:] for r in results]
    dump0 = open(f"{prefix}0.stacks.txt").read()
    assert "## last collectives of this rank" in dump0 and "## Python stacks of every thread" in dump0
    assert os.path.exists(f"{prefix}0"), os.listdir(tmp_path)  # NCCL's flight-recorder trace of rank 0
