"""Muon through pretrain_gpt's providers: TP=2 (whole-matrix orthogonalisation), DP=2 and dist_muon at DP=2
equal one process; the loss falls; save -> load -> continue equals the uninterrupted run; a TP=2
checkpoint loads at TP=1. fp32, dropout 0, Newton-Schulz in fp32 (`--muon-fp32-matmul-prec high`).
Without pretrain: on TP=2 shards, each TP mode's batched step equals its one-matrix-at-a-time step (and TP=1
for duplicated and distributed), with one collective per stack instead of one per matrix.

Layouts differ only in fp32 summation order (~1e-7 relative per op); Newton-Schulz's five iterations
amplify that a little, so per-iteration losses agree to 1e-5 relative over 6 steps.
"""
import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer.muon import TP_MODES
from tests.fixtures.tiny_gpt import mock_data_cache, run_pretrain
from tests.parallel.dist_utils import run_distributed
from tests.unit.core.optimizer.test_muon import _run_muon, _shaped_params

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--seq-length 32 --max-position-embeddings 32 --position-embedding-type rope "
         "--vocab-size 128 --make-vocab-size-divisible-by 64 --tokenizer-type NullTokenizer --mock-data --lr 1e-2 "
         "--train-iters 6 "
         "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 1 --num-workers 0 "
         "--global-batch-size 8 --micro-batch-size 2 --seed 1234 --optimizer muon --muon-fp32-matmul-prec high "
         "--muon-momentum 0.9 --muon-nesterov --weight-decay 0.1")


def _train(extra, parts=None):
    """Per-iteration 'lm loss' of pretrain() with MODEL + extra; ``parts`` (a list) receives, once, each
    chained optimizer's (class name, number of main params, elements of Muon momentum) on this rank."""
    losses = []

    def record(model, opt, out):
        if "lm loss" in out[0]:
            losses.append(float(out[0]["lm loss"]))
        if parts is not None and not parts:
            for part in opt.chained_optimizers:
                momentum = sum(s["momentum_buffer"].numel() for s in part.optimizer.state.values()
                               if "momentum_buffer" in s)
                parts.append((type(part).__name__, len(part.get_parameters()), momentum))
    run_pretrain((MODEL + " " + extra).split(), record)
    return losses


def _dist_muon(ckpt_dir):
    parts = []
    losses = _train(f"--optimizer dist_muon --overlap-grad-reduce --ddp-bucket-size 2000 --save {ckpt_dir}/dm "
                    "--save-interval 3", parts)
    return losses, parts


def _single(ckpt_dir):
    whole = _train("")
    first = _train(f"--train-iters 6 --exit-interval 3 --save {ckpt_dir}/a --save-interval 3")
    rest = _train(f"--load {ckpt_dir}/a")
    return whole, first + rest


def _tp2(ckpt_dir, mode):
    return _train(f"--tensor-model-parallel-size 2 --muon-tp-mode {mode} --save {ckpt_dir}/tp2_{mode} "
                  "--save-interval 3 --exit-interval 3")


def _tp1_from_tp2(ckpt_dir):
    return _train(f"--muon-tp-mode duplicated --load {ckpt_dir}/tp2_duplicated")


def _dp1_from_dist_muon(ckpt_dir):
    return _train(f"--load {ckpt_dir}/dm --ckpt-step 3")


@pytest.fixture(scope="module", autouse=True)
def _mock_data_cache(tmp_path_factory):
    """Every run of the module reads the mock data's indices built by its first run."""
    yield from mock_data_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("muon")
    whole, resumed = run_distributed(_single, 1, d)[0]
    tp2 = {mode: run_distributed(_tp2, 2, d, mode)[0] for mode in ("duplicated", "distributed")}
    dp2 = run_distributed(_train, 2, "")
    dist_muon = run_distributed(_dist_muon, 2, d)
    tp1_from_tp2 = run_distributed(_tp1_from_tp2, 1, d)[0]
    dp1_from_dist_muon = run_distributed(_dp1_from_dist_muon, 1, d)[0]
    return dict(whole=whole, resumed=resumed, tp2=tp2, dp2=dp2, dist_muon=dist_muon, tp1_from_tp2=tp1_from_tp2,
                dp1_from_dist_muon=dp1_from_dist_muon)


def _close(a, b, rel=1e-5):
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"iteration {i + 1}: {x} vs {y}"


def test_loss_falls(runs):
    assert runs["whole"][-1] < runs["whole"][0] - 0.1


def test_tensor_parallel_whole_matrix_equals_one_process(runs):
    for mode in ("duplicated", "distributed"):
        _close(runs["tp2"][mode], runs["whole"][:3])


def test_data_parallel_equals_one_process(runs):
    _close(runs["dp2"][0], runs["whole"])


def test_dist_muon_equals_one_process(runs):
    (losses0, parts0), (losses1, parts1) = runs["dist_muon"]
    _close(losses0, runs["whole"])
    assert losses0 == losses1
    # Each rank holds whole matrices of its own, the 8 Muon weights of 2 x (qkv 64x32 + proj 32x32 + fc1 and
    # fc2 32x128) split nearly evenly; AdamW's params are 1/DP ranges of the distributed optimizer.
    assert [p[0] for p in parts0] == ["DistributedOptimizer", "DistributedOptimizer"]
    assert parts0[0][1] + parts1[0][1] == 8 and 0 < parts0[0][1] < 8
    assert parts0[0][2] + parts1[0][2] == 2 * (64 * 32 + 32 * 32 + 2 * 32 * 128)
    assert min(parts0[0][2], parts1[0][2]) >= 0.8 * max(parts0[0][2], parts1[0][2])  # bin-packed, near even


def test_dist_muon_checkpoint_loads_at_dp1(runs):
    """The layer-wise optimizer's state, saved at DP=2, continues at DP=1 (plain muon) as uninterrupted."""
    _close(runs["dp1_from_dist_muon"], runs["whole"][3:])


def test_resume_equals_uninterrupted(runs):
    _close(runs["resumed"], runs["whole"], rel=1e-6)


def test_tp2_checkpoint_loads_at_tp1(runs):
    """Weights and Muon momentum saved at TP=2 continue at TP=1 as the uninterrupted TP=1 run does."""
    _close(runs["tp1_from_tp2"], runs["whole"][3:])


# The split dim of each of _shaped_params' weights: qkv (whole query groups), tall and odd column-parallel (0);
# square and wide row-parallel (1).
_SPLIT = {(48, 16): 0, (16, 16): 1, (64, 16): 0, (16, 64): 1, (40, 24): 0}


def _tp2_muon_updates():
    """Per TP mode, on this rank's shards: whole-matrix updates of 3 steps (all-gathered) and the number of
    all-reduce / all-gather calls, batched and one matrix at a time."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for mode in TP_MODES:
        for budget in (2 ** 28, 0):
            whole, grads = _shaped_params(6)
            dims = [_SPLIT[tuple(p.shape)] for p in whole]
            params = []
            for p, d in zip(whole, dims):
                shard = torch.nn.Parameter(p.detach().chunk(world, dim=d)[rank].clone())
                shard.tensor_model_parallel, shard.partition_dim = True, d
                shard.is_qkv, shard.qkv_split_shapes = getattr(p, "is_qkv", False), getattr(p, "qkv_split_shapes", None)
                params.append(shard)
            grads = [[g.chunk(world, dim=d)[rank].clone() for g, d in zip(step, dims)] for step in grads]
            calls = {"all_reduce": 0, "all_gather": 0}
            originals = {name: getattr(dist, name) for name in calls}

            def counted(name):
                def call(*args, **kwargs):
                    calls[name] += 1
                    return originals[name](*args, **kwargs)
                return call
            for name in calls:
                setattr(dist, name, counted(name))
            try:
                updates, _ = _run_muon(params, grads, ns_batch_elements=budget, fp32_matmul_prec="high",
                                       tp_mode=mode, tp_group=dist.group.WORLD)
            finally:
                for name, fn in originals.items():
                    setattr(dist, name, fn)
            gathered = []
            for u, d in zip(updates, dims):
                parts = [torch.empty_like(u) for _ in range(world)]
                dist.all_gather(parts, u.contiguous())
                gathered.append(torch.cat(parts, dim=d))
            results[mode, budget] = gathered, calls
    return results


def test_tp2_batched_muon_equals_one_matrix_at_a_time():
    results = run_distributed(_tp2_muon_updates, 2)[0]
    tp1, _ = _run_muon(*_shaped_params(6), ns_batch_elements=0, fp32_matmul_prec="high")
    # 13 local matrices (2 qkv x 3 parts + 2 x 3 plain + 1) in 6 stacks of one shape and split: q parts, k and v
    # parts, square, tall, wide, odd. distributed: 1 norm + 5 Gram all-reduces per matrix or stack and step.
    expected_calls = {"blockwise": ({"all_reduce": 0, "all_gather": 0},) * 2,
                      "duplicated": ({"all_reduce": 0, "all_gather": 3 * 6}, {"all_reduce": 0, "all_gather": 3 * 13}),
                      "distributed": ({"all_reduce": 3 * 6 * 6, "all_gather": 0},
                                      {"all_reduce": 3 * 6 * 13, "all_gather": 0})}
    for mode in TP_MODES:
        (batched, calls), (one, one_calls) = results[mode, 2 ** 28], results[mode, 0]
        assert (calls, one_calls) == expected_calls[mode], mode
        for a, b in zip(batched, one):  # fp32 summation order aside: measured <= 5.6e-7 relative (blockwise)
            assert ((a - b).norm() / b.norm()).item() < 5e-6, mode
        if mode != "blockwise":  # the whole matrix's update, as TP=1 (gathered or Gram sums: fp32 order)
            for a, b in zip(batched, tp1):
                assert ((a - b).norm() / b.norm()).item() < 1e-5, mode
