"""pretrain() end to end in-process: DP=2 equals DP=1 at the same global batch, and gradient
accumulation (mbs 2 x 4) equals one micro-batch of 8. fp32, dropout 0, relative 1e-5 per iteration."""
import pytest

from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 1e-3 --train-iters 6 "
         "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 1 --num-workers 0 "
         "--global-batch-size 8 --seed 1234")

@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    """Every run of the module reads the mock data's indices built by its first run."""
    yield from mock_data_cache(tmp_path_factory)



def _train(extra, base=MODEL):
    """Run pretrain_gpt's providers through pretrain(); return the per-iteration 'lm loss'."""
    losses = []
    def record(model, opt, out):
        if "lm loss" in out[0]:  # only the last pipeline stage has the loss
            losses.append(float(out[0]["lm loss"]))
    run_pretrain((base + " " + extra).split(), record)
    return losses


def _single_process_runs():
    return _train("--micro-batch-size 2"), _train("--micro-batch-size 8")


def _dp2_run():
    return _train("--micro-batch-size 2")


@pytest.fixture(scope="module")
def runs():
    accum, big = run_distributed(_single_process_runs, 1)[0]
    dp2 = run_distributed(_dp2_run, 2)
    return accum, big, dp2


def _close(a, b, rel=1e-5):
    assert len(a) == len(b) == 6
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"iteration {i + 1}: {x} vs {y}"


def test_loss_falls(runs):
    accum, _, _ = runs
    assert accum[-1] < accum[0]


def test_gradient_accumulation_matches_large_micro_batch(runs):
    accum, big, _ = runs
    _close(accum, big)


def test_data_parallel_matches_single_process(runs):
    accum, _, dp2 = runs
    _close(dp2[0], accum)
    assert dp2[0] == dp2[1]  # every rank reports the same DP-reduced loss


def _dp2_two_optimizer_instances_run():
    from megatron.core import parallel_state
    losses, sizes = [], set()

    def record(model, opt, out):
        losses.append(float(out[0]["lm loss"]))
        sizes.add(parallel_state.get_inter_distributed_optimizer_instance_group().size())
    run_pretrain((MODEL + " --micro-batch-size 2 --use-distributed-optimizer "
                  "--num-distributed-optimizer-instances 2").split(), record)
    return losses, sizes


def test_two_distributed_optimizer_instances_match_single_process(runs):
    """--num-distributed-optimizer-instances 2 at DP=2 through pretrain(): each rank is an instance of its own (the
    state replicated, the shards all-reduced across the instances), and trains like one process."""
    accum, _, _ = runs
    (losses, inter_sizes), _ = run_distributed(_dp2_two_optimizer_instances_run, 2)
    assert inter_sizes == {2}
    _close(losses, accum)
