"""QK-clip through pretrain_gpt's providers with a threshold low enough that it clips every step: TP=2, PP=2,
CP=2 and DP=2 with the distributed optimizer (overlapped param all-gather) equal one process, both the loss and
the logged max attention logit, and dist_muon equals muon; bf16 with the distributed optimizer (Adam, dist_muon)
keeps each fp32 main shard equal to its clipped bf16 weight.

fp32, dropout 0: layouts differ only in summation order (~1e-7 relative per op), 1e-5 relative over 5 steps.
"""
import pytest
import torch

from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain
from tests.parallel.dist_utils import run_distributed

THRESHOLD = 0.02
MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--seq-length 32 --max-position-embeddings 32 --position-embedding-type rope "
         "--vocab-size 128 --make-vocab-size-divisible-by 64 --tokenizer-type NullTokenizer --mock-data --lr 3e-3 "
         "--train-iters 5 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 --num-workers 0 "
         "--global-batch-size 8 --micro-batch-size 2 --seed 1234 --log-max-attention-logit "
         f"--qk-clip --qk-clip-threshold {THRESHOLD} --qk-clip-alpha 0.4")


def _train(extra, check_main=False):
    """Per-iteration ('lm loss' or None off the last stage, max attention logit) of pretrain()."""
    record, checked = [], []

    def on_step(model, opt, out):
        record.append((float(out[0]["lm loss"]) if "lm loss" in out[0] else None, out[4]))
        if check_main:
            checked.append(_check_main_shards(opt))
    run_pretrain((MODEL + " " + extra).split(), on_step)
    return (record, checked) if check_main else record


def _check_main_shards(opt):
    """Each fp32 main shard of a QKV weight rounds to its clipped bf16 weight (within the one rounding the two
    paths may differ by); returns how many this rank holds."""
    ranges = [r for r in opt.main_param_ranges() if r[1].dim() == 2 and r[1].shape[0] == 64]  # linear_qkv
    for main, model, lo, hi in ranges:
        weight = model.detach().view(-1)[lo:hi].float()
        torch.testing.assert_close(main.detach().view(-1), weight, rtol=2 ** -7, atol=1e-6)
    return len(ranges)


def _all_runs():
    return {
        "single": run_distributed(_train, 1, "")[0],
        "unclipped": run_distributed(_train, 1, "--qk-clip-threshold 1e9")[0],
        "tp2": run_distributed(_train, 2, "--tensor-model-parallel-size 2"),
        "pp2": run_distributed(_train, 2, "--pipeline-model-parallel-size 2"),
        "cp2": run_distributed(_train, 2, "--context-parallel-size 2"),
        "dp2": run_distributed(_train, 2, "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
                                          "--ddp-bucket-size 2000"),
        "muon": run_distributed(_train, 1, "--optimizer muon --muon-fp32-matmul-prec high")[0],
        "dist_muon": run_distributed(_train, 2, "--optimizer dist_muon --muon-fp32-matmul-prec high"),
        "bf16_dp2": run_distributed(_train, 2, "--bf16 --use-distributed-optimizer", check_main=True),
        "bf16_dist_muon": run_distributed(_train, 2, "--bf16 --optimizer dist_muon", check_main=True),
    }


@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    """Every run of the module reads the mock data's indices built by its first run."""
    yield from mock_data_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def runs():
    return _all_runs()


def _close(got, want, rel=1e-5):
    assert len(got) == len(want) == 5, (got, want)
    for i, ((loss, logit), (loss0, logit0)) in enumerate(zip(got, want)):
        assert abs(loss - loss0) <= rel * abs(loss0), f"iteration {i + 1}: loss {loss} vs {loss0}"
        assert abs(logit - logit0) <= rel * abs(logit0), f"iteration {i + 1}: max logit {logit} vs {logit0}"


def test_clipping_is_active(runs):
    """Each step clips, and the clip shows in the next step's max logit far beyond the 1e-5 the layouts are held
    to, so a layout that clipped wrongly (or not at all) would fail the comparisons below."""
    single, unclipped = runs["single"], runs["unclipped"]
    assert all(logit > THRESHOLD for _, logit in single)
    assert single[0] == unclipped[0]  # the first forward precedes any clip
    assert all(a[1] < 0.8 * b[1] for a, b in zip(single[1:], unclipped[1:]))
    assert all(a[0] != b[0] for a, b in zip(single[1:], unclipped[1:]))


@pytest.mark.parametrize("layout", ["tp2", "cp2", "dp2"])
def test_layout_equals_one_process(runs, layout):
    for rank_record in runs[layout]:
        _close(rank_record, runs["single"])


def test_pipeline_equals_one_process(runs):
    first, last = runs["pp2"]
    assert [logit for _, logit in first] == [logit for _, logit in last]  # the max is over both stages
    _close(last, runs["single"])


def test_dist_muon_equals_muon(runs):
    for rank_record in runs["dist_muon"]:
        _close(rank_record, runs["muon"])


@pytest.mark.parametrize("run", ["bf16_dp2", "bf16_dist_muon"])
def test_bf16_main_shards_follow_the_clip(runs, run):
    """Checked after every step on every rank (`_check_main_shards`); both layers' QKV weights have main
    shards somewhere (Adam: a range on each rank; dist_muon: whole matrices on their owners)."""
    for record, _ in runs[run]:
        assert all(logit > THRESHOLD for _, logit in record)
    assert sum(checked[0] for _, checked in runs[run]) >= 2
