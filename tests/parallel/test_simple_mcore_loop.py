"""The Megatron Core quick-start loop (examples/run_simple_mcore_train_loop.py) at TP=2 on gloo.

The example's own functions are used unchanged (Megatron's pattern: TE-named GPT layer spec,
DistributedDataParallel + finalize_model_grads, get_forward_backward_func, dist_checkpointing); the TP=2
checkpoint it writes is then loaded into a TP=1 model (same processes, DP=2), which must give the same
loss on the same batch (resharding through dist_checkpointing). The same world also checks the
process-group and 1-D split/gather APIs that such scripts use.
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


def _group_api_checks():
    """ProcessGroupCollection and the 1-D split/gather pair on the live TP=2 groups."""
    from megatron.core import mpu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    full = torch.arange(12.0)
    chunk = split_tensor_into_1d_equal_chunks(full, new_buffer=True)
    return (pgs.tp.size(), pgs.dp.size(), pgs.hcp, mpu.get_tensor_model_parallel_rank(), chunk.tolist(),
            torch.equal(gather_split_1d_tensor(chunk), full))


def _train_tp2_then_load_tp1(ckpt_dir):
    ex = _example()
    history, max_diff = ex.main(tp=2, pp=1, iters=4, ckpt_dir=ckpt_dir)
    groups = _group_api_checks()
    eval_tp2 = _eval_loss(ex, ex.load_distributed_checkpoint(ckpt_dir, ex.model_provider()))
    ex.initialize_distributed(1, 1)  # same 2 processes, now TP=1 x DP=2
    ex.model_parallel_cuda_manual_seed(7)  # a different init: the values must come from the checkpoint
    model = ex.load_distributed_checkpoint(ckpt_dir, ex.model_provider())
    eval_tp1 = _eval_loss(ex, model)
    from megatron.core.dist_checkpointing import load_plain_tensors
    from megatron.core.utils import check_param_hashes_across_dp_replicas
    plain = load_plain_tensors(ckpt_dir)  # whole tensors; at TP=1 they equal the model's
    state = model.state_dict()
    plain_matches = all(torch.equal(plain[k], state[k]) for k in plain if k in state) and len(plain) > 0
    return history, max_diff, eval_tp2, eval_tp1, groups, plain_matches, check_param_hashes_across_dp_replicas(model)


def test_quickstart_loop_tp2_trains_saves_and_reshards(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    r0, r1 = run_distributed(_train_tp2_then_load_tp1, 2, ckpt)
    (hist0, diff0, eval0, tp1_0, groups0, plain0, hashes0), (hist1, diff1, eval1, tp1_1, groups1, _, _) = r0, r1
    assert len(hist0) == 4 and hist0 == hist1, "TP ranks must report the same loss"
    assert hist0[-1] < hist0[0], f"loss did not fall: {hist0}"
    assert diff0 == 0.0 and diff1 == 0.0, "reloaded parameters differ from the saved ones"
    assert eval0 == eval1
    # fp32 on CPU; TP=2 splits the vocab-parallel softmax and row-parallel sums differently: ~1e-6 relative.
    assert tp1_0 == tp1_1 and abs(tp1_0 - eval0) <= 1e-5 * abs(eval0), (tp1_0, eval0)
    # TP=2, DP=1 groups; no hierarchical CP group; each TP rank holds its half of the flattened tensor.
    assert groups0 == (2, 1, None, 0, [0.0, 1, 2, 3, 4, 5], True), groups0
    assert groups1 == (2, 1, None, 1, [6.0, 7, 8, 9, 10, 11], True), groups1
    assert plain0, "load_plain_tensors must return the checkpoint's whole tensors"
    assert hashes0, "DP replicas loaded from one checkpoint must hold identical parameters"
