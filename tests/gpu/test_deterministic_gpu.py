"""--deterministic-mode on the GPU: two runs of pretrain_gpt.py with the same flags give bitwise identical
losses and grad norms at every iteration (bf16, dropout on, the default attention backend, and DP=2 over
NCCL when two GPUs are present). Without the flag the same pair of runs differs (cuDNN attention and
flash backward accumulate in a varying order), which shows the test can fail. Skipped without CUDA."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.benchmark_runs import failure_text

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
         "--micro-batch-size 4 --global-batch-size 8 --bf16 --train-iters 12 --lr 3e-4 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 32000 --log-interval 4 --eval-iters 0 --num-workers 0").split()

# Runs pretrain_gpt.py in this process and writes every (lm loss, grad norm) as exact floats.
DRIVER = """
import json, runpy, sys
import megatron.training.training as training
out, record, step = sys.argv[1], [], training.train_step
def recording(*a, **k):
    result = step(*a, **k)
    record.append([float(result[0]["lm loss"]) if result[0] else None, float(result[2])])
    return result
training.train_step = recording
sys.argv = ["pretrain_gpt.py"] + sys.argv[2:]
try:
    runpy.run_path("pretrain_gpt.py", run_name="__main__")
finally:
    with open(out + "." + __import__("os").environ.get("RANK", "0"), "w") as f:
        json.dump(record, f)
"""


def _run(tmp_path, name, nproc, *flags):
    out = str(tmp_path / name)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--nproc-per-node", str(nproc), "--standalone"]
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG")}
    p = subprocess.run(launcher + [str(driver), out] + FLAGS + list(flags), cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**env, "PYTHONPATH": ROOT})
    assert p.returncode == 0, failure_text(p)
    with open(out + ".0") as f:
        return json.load(f)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices"))])
def test_two_deterministic_runs_are_bitwise_equal(tmp_path, nproc):
    first = _run(tmp_path, "a", nproc, "--deterministic-mode")
    second = _run(tmp_path, "b", nproc, "--deterministic-mode")
    assert len(first) == 12 and len({loss for loss, _ in first}) > 6  # it trains
    assert first == second  # exact floats: losses and grad norms bitwise equal


def test_without_the_flag_runs_differ(tmp_path):
    """The control: the same pair of runs without --deterministic-mode is not bitwise equal."""
    assert _run(tmp_path, "a", 1) != _run(tmp_path, "b", 1)


def test_cpu_initialization_builds_on_cpu():
    """--use-cpu-initialization: parameters are created and filled on the CPU, then moved by get_model."""
    from megatron.core import parallel_state as ps
    from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt
    from tests.parallel.dist_utils import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
        models = {}
        for cpu in (True, False):
            cfg = tiny_config(hidden_size=64, use_cpu_initialization=cpu)
            models[cpu] = tiny_gpt(cfg, vocab_size=128, max_sequence_length=32,
                                   share_embeddings_and_output_weights=False)
        assert {p.device.type for p in models[True].parameters()} == {"cpu"}
        assert {p.device.type for p in models[False].parameters()} == {"cuda"}
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
