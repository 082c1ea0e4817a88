"""The Megatron Core quick-start loop (examples/run_simple_mcore_train_loop.py) at TP=2 on gloo.

The example's own functions are used unchanged; the TP=2 checkpoint it writes is then loaded into a
TP=1 model (same processes, DP=2), which must give the same loss on the same batch (resharding through dist_checkpointing).
"""
import importlib.util
import os
from functools import partial

import torch

from tests.parallel.dist_utils import run_distributed

_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "run_simple_mcore_train_loop.py")


def _example():
    spec = importlib.util.spec_from_file_location("run_simple_mcore_train_loop", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _eval_loss(ex, model):
    """Forward-only loss (dropout off) of the first batch of a fresh data iterator (same on every rank)."""
    model.eval()
    losses = ex.get_forward_backward_func()(
        forward_step_func=partial(ex.forward_step_func, device=torch.device("cpu")),
        data_iterator=ex.get_train_data_iterator(), model=model, num_microbatches=1,
        seq_length=ex._SEQUENCE_LENGTH, micro_batch_size=ex._MICRO_BATCH_SIZE, forward_only=True)
    return losses[0]["lm loss"].item()


def _train_tp2_then_load_tp1(ckpt_dir):
    ex = _example()
    history, max_diff = ex.main(tp=2, pp=1, iters=4, ckpt_dir=ckpt_dir)
    eval_tp2 = _eval_loss(ex, ex.load_distributed_checkpoint(ckpt_dir, ex.model_provider()))
    ex.initialize_distributed(1, 1)  # same 2 processes, now TP=1 x DP=2
    ex.model_parallel_cuda_manual_seed(7)  # a different init: the values must come from the checkpoint
    eval_tp1 = _eval_loss(ex, ex.load_distributed_checkpoint(ckpt_dir, ex.model_provider()))
    return history, max_diff, eval_tp2, eval_tp1


def test_quickstart_loop_tp2_trains_saves_and_reshards(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (hist0, diff0, eval0, tp1_0), (hist1, diff1, eval1, tp1_1) = run_distributed(_train_tp2_then_load_tp1, 2, ckpt)
    assert len(hist0) == 4 and hist0 == hist1, "TP ranks must report the same loss"
    assert hist0[-1] < hist0[0], f"loss did not fall: {hist0}"
    assert diff0 == 0.0 and diff1 == 0.0, "reloaded parameters differ from the saved ones"
    assert eval0 == eval1
    # fp32 on CPU; TP=2 splits the vocab-parallel softmax and row-parallel sums differently: ~1e-6 relative.
    assert tp1_0 == tp1_1 and abs(tp1_0 - eval0) <= 1e-5 * abs(eval0), (tp1_0, eval0)
