"""MoE on 2 CPU ranks that form both the tensor-parallel and the expert-parallel group (TP=2, EP=2).

With the default expert-TP (= TP) the expert grid needs ETP x EP = 4 ranks, which argument validation refuses, as
Megatron's initialize_model_parallel does. In-process (run_distributed's library mode) that refusal must reach the
caller on every rank within seconds: a rank that ends its process instead leaves the caller waiting on its own
timeout, which reads as a hang. A refusal on one rank alone must stop the rank that passed validation too.
With --expert-tensor-parallel-size 1 the layout trains and reproduces the single-process loss (fp32, dropout 0,
no token dropping, relative 1e-5: the layouts only reorder fp32 sums), with SP and the alltoall dispatcher or
without SP and the allgather dispatcher.
"""
import pytest
import torch

from tests.fixtures.tiny_gpt import run_pretrain
from tests.parallel.dist_utils import run_distributed
from tests.parallel.test_moe_invariance import A2A, MODEL

TP_EP = "--tensor-model-parallel-size 2 --expert-model-parallel-size 2"
LAYOUTS = {
    "etp1_sp_alltoall": f"{A2A} {TP_EP} --expert-tensor-parallel-size 1 --sequence-parallel",
    "etp1_allgather": f"--moe-token-dispatcher-type allgather {TP_EP} --expert-tensor-parallel-size 1",
}
# A regression ends in this many seconds with the queue's Empty, not at run_distributed's 300 s default.
TIMEOUT_S = 90


def _train(extra, cache):
    losses = []

    def record(model, optimizer, out):
        if out[0]:
            losses.append(float(out[0]["lm loss"]))

    run_pretrain((MODEL + f" --data-cache-path {cache} " + extra).split(), record, capture_stdout=True)
    return losses


def _outcome(extra, cache):
    """What the caller sees of a run that stops at start-up: the exception's type and message."""
    try:
        _train(extra, cache)
    except (Exception, SystemExit) as e:
        return type(e).__name__, str(e)
    return None


def _two_ranks(cache):
    rank = torch.distributed.get_rank()
    refused = _outcome(f"{A2A} {TP_EP} --sequence-parallel", cache)
    # Rank 1 alone fails validation (8 is not a multiple of 3); rank 0 passes and must stop as well.
    one_rank = _outcome(f"{A2A} {TP_EP} --expert-tensor-parallel-size 1" +
                        (" --global-batch-size 3" if rank == 1 else ""), cache)
    # The refusals left the world usable: the same processes then train.
    return refused, one_rank, {name: _train(flags, cache) for name, flags in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_data_cache"))
    ref = run_distributed(_train, 1, A2A, cache, timeout=TIMEOUT_S)[0]
    return ref, run_distributed(_two_ranks, 2, cache, timeout=TIMEOUT_S)


def test_default_expert_tp_is_refused_on_every_rank(runs):
    _, ranks = runs
    for refused, _, _ in ranks:
        assert refused == ("ArgumentError", "world size (2) must be divisible by --expert-tensor-parallel-size "
                           "(2, its default: --tensor-model-parallel-size) x --expert-model-parallel-size (2) x "
                           "--pipeline-model-parallel-size (1)")


def test_refusal_on_one_rank_stops_the_other(runs):
    _, ranks = runs
    assert ranks[0][1] == ("SystemExit", "2")
    assert ranks[1][1][0] == "ArgumentError" and "--global-batch-size (3)" in ranks[1][1][1]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(runs, name):
    ref, ranks = runs
    assert len(ref) >= 2  # MODEL's --train-iters
    for _, _, layouts in ranks:
        losses = layouts[name]
        assert len(losses) == len(ref)
        for i, (x, y) in enumerate(zip(losses, ref)):
            assert abs(x - y) <= 1e-5 * abs(y), f"iteration {i + 1}: {x} vs {y}"
