"""pretrain_gpt.get_batch under TP=2: without packed documents the batch reaches TP rank 1 through broadcasts
of shapes every rank knows (no size exchange, so no host synchronisation per micro-batch); with packed
documents (--reset-attention-mask) the per-sample document offsets still travel with their sizes. Both train
as TP=1 x DP=2 on the same global batch (fp32, 1e-5 relative per iteration)."""
import pytest

from tests.fixtures.tiny_gpt import mock_data_cache
from tests.parallel.dist_utils import run_distributed
from tests.parallel.test_training_invariance import _train

PLAIN = "--micro-batch-size 2 --eval-iters 0 --make-vocab-size-divisible-by 64"  # vocab 128 at TP 1 and 2
PACKED = PLAIN + " --reset-attention-mask --reset-position-ids --eod-mask-loss"

@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    """Every run of the module reads the mock data's indices built by its first run."""
    yield from mock_data_cache(tmp_path_factory)



def _tp2_counting_size_exchanges(flags):
    import megatron.core.tensor_parallel.data as data
    sized, real = [], data.dist.broadcast

    def counting(tensor, src, group=None, **kw):
        sized.append(tensor.dim() == 2 and tensor.size(1) == 8)  # broadcast_data's [keys, 8] sizes tensor
        return real(tensor, src, group=group, **kw)
    data.dist.broadcast = counting
    try:
        return _train(flags + " --tensor-model-parallel-size 2"), sum(sized)
    finally:
        data.dist.broadcast = real


def _runs():
    return [(*_tp2_counting_size_exchanges(flags), _train(flags)) for flags in (PLAIN, PACKED)]


def test_tp2_get_batch_equals_dp2():
    (plain, packed), _ = run_distributed(_runs, 2)
    assert plain[1] == 0, f"{plain[1]} batch broadcasts exchanged sizes"
    assert packed[1] == 6 * 4  # one per micro-batch: the document offsets' sizes vary
    for tp2, _, dp2 in (plain, packed):
        assert len(tp2) == len(dp2) == 6 and tp2[-1] < tp2[0]
        for a, b in zip(tp2, dp2):
            assert a == pytest.approx(b, rel=1e-5)
