"""--overlap-moe-expert-parallel-comm and --delay-wgrad-compute at EP=2 on 2 gloo ranks, through
pretrain(): each run's loss and grad norm per iteration equal the plain run's. The overlap runs the
same operations in the same order on each side (bitwise equal); the delayed weight gradient is the
same sum computed by a per-expert GEMM instead of autograd's (fp32, 1e-6 relative).
4 micro-batches per step (gbs 8, mbs 1, DP 2), so 3 of each step's 4 forwards run beside a backward (from the
second step on: the first runs the same plan sequentially). With random host delays before each all-to-all,
different on each rank, both ranks still launch the two threads' collectives in one order (launch_order.py),
and while the two sides run at once the interpreter lock changes hands within combined_1f1b.GIL_SWITCH_S."""
import random
import sys
import time

import pytest

from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --make-vocab-size-divisible-by 32 --tokenizer-type NullTokenizer --mock-data --lr 1e-2 "
         "--train-iters 3 --swiglu --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 "
         "--eval-interval 1000 --num-workers 0 --global-batch-size 8 --micro-batch-size 1 --seed 1234 "
         "--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
         "--moe-shared-expert-intermediate-size 16 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
         "--expert-model-parallel-size 2")
RUNS = {
    "plain": "",
    "overlap": "--overlap-moe-expert-parallel-comm",
    "delay": "--delay-wgrad-compute",
    "overlap_delay": "--overlap-moe-expert-parallel-comm --delay-wgrad-compute",
    "overlap_delay_grad_reduce": "--overlap-moe-expert-parallel-comm --delay-wgrad-compute "
                                 "--use-distributed-optimizer --overlap-grad-reduce",
    "plain_grad_reduce": "--use-distributed-optimizer --overlap-grad-reduce",
}


def _jittered_trace(flags):
    """The overlapped run with a random host delay (0-3 ms, seeded by rank) before every all-to-all: the
    sequence of sides (0 forward, 1 backward) in which this rank launched the EP collectives."""
    import torch.distributed as dist

    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.launch_order import ORDER

    real, rng = token_dispatcher._all_to_all, random.Random(dist.get_rank())

    intervals = set()

    def delayed(*args, **kwargs):
        intervals.add(sys.getswitchinterval())
        time.sleep(rng.random() * 3e-3)
        return real(*args, **kwargs)

    token_dispatcher._all_to_all, ORDER.trace = delayed, []
    try:
        run_pretrain((MODEL + " " + flags).split(), lambda *a: None)
        return list(ORDER.trace), sorted(intervals), sys.getswitchinterval()
    finally:
        token_dispatcher._all_to_all, ORDER.trace = real, None


def _runs():
    from megatron.core.pipeline_parallel import combined_1f1b

    out = {"jittered_trace": _jittered_trace(RUNS["overlap_delay"])}
    for name, flags in RUNS.items():
        curve = []

        def record(model, optimizer, result):
            curve.append((float(result[0]["lm loss"]), float(result[2])))

        before = combined_1f1b.stats["overlapped_forwards"]
        run_pretrain((MODEL + " " + flags).split(), record)
        out[name] = (curve, combined_1f1b.stats["overlapped_forwards"] - before)
    return out


@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    """Every run of the module reads the mock data's indices built by its first run."""
    yield from mock_data_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_runs, 2, timeout=600)


def _close(a, b, rel):
    assert len(a) == len(b) == 3
    for i, ((la, ga), (lb, gb)) in enumerate(zip(a, b)):
        assert abs(la - lb) <= rel * abs(lb), f"iteration {i + 1}: loss {la} vs {lb}"
        assert abs(ga - gb) <= rel * abs(gb), f"iteration {i + 1}: grad norm {ga} vs {gb}"


@pytest.mark.parametrize("name,ref,rel", [
    ("overlap", "plain", 0.0),
    ("delay", "plain", 1e-6),
    ("overlap_delay", "delay", 0.0),
    ("overlap_delay_grad_reduce", "plain_grad_reduce", 1e-6),
])
def test_matches_plain_run(runs, name, ref, rel):
    for rank in runs:
        _close(rank[name][0], rank[ref][0], rel)


def test_forwards_ran_beside_backwards(runs):
    for rank in runs:
        assert rank["plain"][1] == 0 and rank["delay"][1] == 0
        assert rank["overlap"][1] == 2 * 3  # 3 steps, the first sequential: 2 x (4 micro-batches - 1)
        assert rank["overlap_delay"][1] == 2 * 3


def test_ranks_launch_the_collectives_in_one_order(runs):
    """Timing on each rank differs (the delays); the launch sequence does not. Without the order the two
    threads interleave by timing, and a different order on two ranks can hang NCCL."""
    traces = [rank["jittered_trace"][0] for rank in runs]
    assert traces[0] and 0 in traces[0] and 1 in traces[0]
    assert traces[0] == traces[1]


def test_the_lock_changes_hands_quickly_only_while_both_sides_run(runs):
    """The first step runs the sides one after the other at the interpreter's interval; the later steps' windows
    at GIL_SWITCH_S; after the run the interval is the interpreter's again."""
    from megatron.core.pipeline_parallel.combined_1f1b import GIL_SWITCH_S

    for rank in runs:
        _, seen, after = rank["jittered_trace"]
        assert seen == [GIL_SWITCH_S, after] and after > GIL_SWITCH_S
