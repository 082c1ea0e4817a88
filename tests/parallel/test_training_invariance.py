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


def _step_schedule_runs():
    from megatron.core import num_microbatches_calculator as mbc
    out = {}
    # seq 32: thresholds in tokens, 256 tokens = 8 samples; micro-batch 2.
    for name, extra in (("samples", "--train-samples 24 --step-batch-size-schedule 0:4,256:8"),
                        ("constant", "--train-iters 4 --global-batch-size 4")):
        sizes, losses = [], []

        def record(model, opt, result):
            sizes.append(mbc.get_current_global_batch_size())
            losses.append(float(result[0]["lm loss"]))
        argv = MODEL.replace("--train-iters 6", "").replace("--global-batch-size 8", "")
        run_pretrain((argv + " --micro-batch-size 2 " + extra).split(), record)
        out[name] = sizes, losses
    return out


def test_step_batch_size_schedule_sets_each_steps_global_batch(runs):
    """--step-batch-size-schedule '0:4,256:8' (thresholds in tokens: 8 samples at seq 32) trains two steps of 4
    samples, then steps of 8: a run of --train-samples 24 takes 4 steps (4 + 4 + 8 + 8). Its first two steps read
    the same samples as a constant batch of 4 over as many steps (the same learning rates) and give the same
    losses."""
    (result,) = run_distributed(_step_schedule_runs, 1)
    sizes, losses = result["samples"]
    assert sizes == [4, 4, 8, 8]
    assert losses[:2] == pytest.approx(result["constant"][1][:2], rel=1e-6)
    assert result["constant"][0] == [4, 4, 4, 4]


def _eval_batch_runs():
    import re
    out = {}
    for extra in ("", "--eval-micro-batch-size 4"):
        log = run_pretrain((MODEL.replace("--train-iters 6", "--train-iters 2") + " --micro-batch-size 2 "
                            "--eval-interval 2 " + extra).split(), capture_stdout=True)
        out[extra] = [float(v) for v in re.findall(r"validation loss at [^|]*\| lm loss value: ([0-9.E+-]+)", log)]
    return out


def test_eval_micro_batch_size_reads_the_same_samples(runs):
    """--eval-micro-batch-size 4 evaluates the same --eval-global-batch-size (8, the training one's by default) in 2
    micro-batches per step instead of 4: the same samples, the same validation and test losses."""
    (result,) = run_distributed(_eval_batch_runs, 1)
    default, bigger = result[""], result["--eval-micro-batch-size 4"]
    assert len(default) == 3  # at iteration 2, after training, on the test set
    assert bigger == pytest.approx(default, rel=1e-5)
