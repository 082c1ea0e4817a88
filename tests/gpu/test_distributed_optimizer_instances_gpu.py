"""--num-distributed-optimizer-instances 2 over NCCL: each bucket's reduce-scatter within an instance and the shard's
all-reduce across instances run in order on a side stream, overlapped with the backward (--overlap-grad-reduce) and
followed by the overlapped parameter all-gather. The run follows the one-instance run of the same layout: on two GPUs
(each rank an instance of its own: the all-reduce alone) and on four (two ranks per instance: both steps).
tests/parallel/test_distributed_optimizer_instances.py proves the arithmetic in fp32 on CPU."""
import pytest
import torch

from tests.gpu.benchmark_runs import run_two_gpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

FLAGS = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --lr 1e-4"


def _follows(tmp_path, nproc):
    gbs = f"--global-batch-size {8 * nproc}"
    one = run_two_gpus(tmp_path, f"one-{nproc}", FLAGS, *gbs.split(), iters=10, nproc=nproc)
    two = run_two_gpus(tmp_path, f"two-{nproc}", FLAGS, *gbs.split(), "--num-distributed-optimizer-instances", "2",
                       iters=10, nproc=nproc)
    assert len(set(two["losses"])) > 5
    # bf16 with the same kernels; only the gradients' summation order differs (within then across instances).
    assert two["losses"] == pytest.approx(one["losses"], abs=2e-2)


def test_two_instances_on_two_gpus_follow_one(tmp_path):
    _follows(tmp_path, 2)


@pytest.mark.four_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA devices")
def test_two_instances_on_four_gpus_follow_one(tmp_path):
    _follows(tmp_path, 4)
