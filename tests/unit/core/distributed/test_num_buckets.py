"""--ddp-num-buckets: DDP sizes its buckets as the rank's parameters divided by the count (Megatron's rule), which
gives about that many buckets with the grad reduce overlapped (the flag's one-line refusals: test_arguments.py)."""
import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel import buckets_of
from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt


def _ddp(**kw):
    single_rank()
    torch.manual_seed(0)
    config = tiny_config(hidden_size=32, num_layers=4)
    model = tiny_gpt(config, vocab_size=64)
    return DistributedDataParallel(config, DistributedDataParallelConfig(**kw), model), model


@pytest.mark.parametrize("n", [1, 3, 6])
def test_bucket_count_follows_num_buckets(n):
    ddp, model = _ddp(num_buckets=n, overlap_grad_reduce=True)
    total = sum(p.numel() for p in model.parameters())
    assert ddp.bucket_size == buckets_of(total, n) == total // n
    buckets = [b for buf in ddp.buffers for b in buf.buckets]
    # a bucket closes at the first param that reaches the size, so a count can round down (never above n)
    assert max(1, n - 2) <= len(buckets) <= n


def test_without_overlap_one_bucket_per_buffer():
    ddp, _ = _ddp(num_buckets=4)
    assert ddp.bucket_size is None


def test_config_refuses_both_sizes():
    with pytest.raises(ValueError, match="pass one"):
        DistributedDataParallelConfig(num_buckets=2, bucket_size=10)
    with pytest.raises(ValueError, match="must be > 0"):
        DistributedDataParallelConfig(num_buckets=0)
