"""MoE through pretrain() on CPU: every expert/tensor/pipeline/data layout reproduces the single-process
loss per iteration (fp32, dropout 0, no token dropping, relative 1e-5: the layouts only reorder fp32 sums).
One 4-rank world runs all layouts in turn; the references are two single-process runs."""
import contextlib
import io
import sys

import pytest

from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 1e-2 --train-iters 4 --swiglu "
         "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 --eval-interval 1000 "
         "--num-workers 0 --global-batch-size 8 --micro-batch-size 2 --seed 1234 --disable-bias-linear "
         "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
         "--moe-shared-expert-intermediate-size 16 --clip-grad 0.05")

GROUPED = "--moe-grouped-gemm --moe-token-dispatcher-type alltoall"
SEQUENTIAL = "--moe-token-dispatcher-type allgather"

LAYOUTS = {  # name -> (experts, layout flags), all on 4 ranks
    "ep4": (GROUPED, "--expert-model-parallel-size 4"),
    "ep2_tp2_sp": (GROUPED, "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel"),
    "ep2_pp2": (GROUPED, "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2"),
    "etp2_ep2": (GROUPED, "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 "
                          "--expert-model-parallel-size 2"),
    "ep2_distopt": (GROUPED, "--expert-model-parallel-size 2 --use-distributed-optimizer"),
    "allgather_ep2_tp2": (SEQUENTIAL, "--expert-model-parallel-size 2 --tensor-model-parallel-size 2"),
}


def _train(extra):
    """pretrain_gpt's providers through pretrain(); per-iteration 'lm loss' and the printed log."""
    import megatron.training.training as training
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars

    losses, step = [], training.train_step

    def recording_train_step(*a, **k):
        out = step(*a, **k)
        if out[0]:
            losses.append(float(out[0]["lm loss"]))
        return out

    training.train_step = recording_train_step
    sys.argv = ["pretrain_gpt.py"] + (MODEL + " " + extra).split()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                              ModelType.encoder_or_decoder, pretrain_gpt.forward_step)
    finally:
        training.train_step = step
        destroy_global_vars()
    return losses, log.getvalue()


def _references():
    return {"grouped": _train(GROUPED), "sequential": _train(SEQUENTIAL)}


def _layouts():
    return {name: _train(f"{experts} {flags}")[0] for name, (experts, flags) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs():
    refs = run_distributed(_references, 1)[0]
    layouts = run_distributed(_layouts, 4, timeout=600)
    return refs, layouts


def _close(a, b, rel=1e-5):
    assert len(a) == len(b) == 4
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * abs(y), f"iteration {i + 1}: {x} vs {y}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(runs, name):
    refs, layouts = runs
    ref = refs["grouped" if LAYOUTS[name][0] == GROUPED else "sequential"][0]
    losses = [r[name] for r in layouts if r[name]]  # ranks of the last pipeline stage
    assert losses
    for rank_losses in losses:
        _close(rank_losses, ref)


def test_log_line_has_moe_losses_and_load(runs):
    refs, _ = runs
    losses, log = refs["grouped"]
    assert losses[-1] < losses[0]
    line = next(line for line in log.splitlines() if "iteration        2/" in line)
    assert line.index("lm loss:") < line.index("load_balancing_loss:") < line.index("z_loss:")
    assert "moe max load:" in line and "moe min load:" in line
