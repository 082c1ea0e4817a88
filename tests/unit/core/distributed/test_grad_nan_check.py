"""--check-for-nan-in-loss-and-grad also checks each DP bucket's local gradients before their reduction
(Megatron's DDP check): the verdict waits on the device inside a training step and stops the run with the
bucket and its parameters named when the step's pass ends."""
import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.rerun_state_machine import (
    RerunDataIterator,
    destroy_rerun_state_machine,
    initialize_rerun_state_machine,
)
from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt


def _model(check):
    single_rank()
    config = tiny_config(hidden_size=32)
    model = tiny_gpt(config, vocab_size=64)
    return DistributedDataParallel(config, DistributedDataParallelConfig(check_for_nan_in_grad=check), model)


def _backward(model, poison):
    model.zero_grad_buffer()
    tokens = torch.randint(0, 64, (2, 16))
    out = model(tokens, torch.arange(16)[None].expand(2, 16), None, labels=tokens)
    if poison:
        out = out * torch.tensor(float("nan"))  # every gradient NaN; the loss itself is not validated here
    out.sum().backward()
    model.finish_grad_sync()


def test_nan_grads_stop_the_step_with_the_bucket_named():
    rsm = initialize_rerun_state_machine(mode="disabled")
    try:
        model = _model(check=True)
        it = RerunDataIterator(iter(range(4)))
        assert rsm.should_run_forward_backward(it)
        _backward(model, poison=False)
        assert rsm.pending and not rsm.decisions  # clean grads: queued verdicts, no host read per bucket
        assert not rsm.should_run_forward_backward(it)
        assert rsm.should_run_forward_backward(it)
        _backward(model, poison=True)  # no raise inside the backward
        with pytest.raises(RuntimeError, match=r"found NaN in local grad norm for bucket #0 in backward pass "
                                               r"before data-parallel communication collective \(params: .*"):
            rsm.should_run_forward_backward(it)
        # Off (--no-check-for-nan-in-loss-and-grad): nothing is validated.
        rsm = initialize_rerun_state_machine(mode="disabled")
        model = _model(check=False)
        assert rsm.should_run_forward_backward(it)
        _backward(model, poison=True)
        assert not rsm.pending and not rsm.should_run_forward_backward(it)
    finally:
        destroy_rerun_state_machine()
