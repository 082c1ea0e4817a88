"""RerunStateMachine in one process: a rejected result re-runs the step on the same micro-batch and RNG
state; the diagnosis follows the re-run (reference: the outcome table in docs/troubleshooting.md)."""
from functools import partial

import torch

from megatron.core.rerun_state_machine import RerunDataIterator, RerunStateMachine


def _step(rsm, it, values):
    """One training step; ``values`` gives the loss of the first run and of the re-run."""
    seen = []
    while rsm.should_run_forward_backward(it):
        batch, noise = next(it), torch.rand(1).item()
        loss = torch.tensor(values[len(seen)])
        rsm.validate_result(loss, partial(rsm.is_unexpectedly_large, threshold=10, context="loss", num_samples=3),
                            "spiky loss", fatal=False)
        rsm.validate_result(loss, torch.isnan, "NaN loss", fatal=True)
        seen.append((batch, noise))
    return seen


def test_spike_and_nan_decisions():
    rsm = RerunStateMachine(mode="validate_results")
    it = RerunDataIterator(iter(range(100)))
    for _ in range(3):  # the spike detector's first samples set the scale (max 1.0)
        assert len(_step(rsm, it, [1.0])) == 1
    runs = _step(rsm, it, [50.0, 50.0])
    assert runs[0] == runs[1]  # same micro-batch, same RNG draw
    assert rsm.decisions[-1]["diagnosis"] == "persistent_error" and rsm.decisions[-1]["decision"] == "report"
    _step(rsm, it, [50.0, 1.0])
    assert rsm.decisions[-1]["diagnosis"] == "transient_error" and rsm.decisions[-1]["decision"] == "report"
    assert rsm.should_checkpoint_and_exit() == (False, False, 0) and not rsm.should_skip_step()
    _step(rsm, it, [float("nan"), float("nan")])
    assert rsm.decisions[-1]["decision"] == "skip" and rsm.should_skip_step()
    before = torch.get_rng_state()
    _step(rsm, it, [float("nan"), 1.0])
    assert rsm.decisions[-1]["decision"] == "stop" and rsm.should_checkpoint_and_exit() == (True, True, 17)
    assert [d["iteration"] for d in rsm.decisions] == [3, 4, 5, 6]  # 0-based; train() numbers as its log
    # A stop leaves the state of the failed step's start for the checkpoint (as Megatron): its RNG, and its
    # micro-batch (the 7th) next in line.
    assert torch.equal(torch.get_rng_state(), before)
    assert next(it) == 6
    restored = RerunStateMachine(mode="validate_results")
    restored.load_state_dict(rsm.state_dict())
    assert restored.decisions == rsm.decisions and restored.max_values == {"loss": 1.0}


def test_tensor_verdicts_inside_the_step_are_judged_at_its_end():
    """A device verdict (torch.isnan of the loss) is not read back at the call, which would synchronise the
    host once per micro-batch; the step's end judges all of them, in call order, before any update."""
    import pytest
    rsm = RerunStateMachine(mode="disabled")
    it = RerunDataIterator(iter(range(10)))
    assert rsm.should_run_forward_backward(it)
    rsm.validate_result(torch.tensor(1.0), torch.isnan, "NaN loss", fatal=True)
    rsm.validate_result(torch.tensor(float("nan")), torch.isnan, "NaN loss", fatal=True)  # no raise here
    assert len(rsm.pending) == 2 and not rsm.decisions
    with pytest.raises(RuntimeError, match="NaN loss"):
        rsm.should_run_forward_backward(it)
    assert rsm.decisions[-1]["decision"] == "stop" and rsm.decisions[-1]["initial_result"] != 1.0
    # validate_results: the first rejected call of the step is the one the re-run compares against.
    rsm = RerunStateMachine(mode="validate_results")
    values = iter([2.0, float("inf"), 3.0, 2.0, float("inf"), 3.0])
    while rsm.should_run_forward_backward(it):
        for _ in range(3):
            rsm.validate_result(torch.tensor(next(values)), torch.isinf, "Inf loss", fatal=True)
        if rsm.state.name == "INITIAL_RUN":
            assert rsm.pending and not rsm.rerun_requested  # judged only when the step's passes end
    assert rsm.failed_call == ("Inf loss", 2) and rsm.initial_result == float("inf")
    assert rsm.decisions[-1]["decision"] == "skip"  # reproduced: the data or the model, not the device
    # Outside a step (evaluation) and for Python-bool verdicts the judgement stays immediate.
    with pytest.raises(RuntimeError, match="NaN eval"):
        RerunStateMachine(mode="disabled").validate_result(torch.tensor(float("nan")), torch.isnan, "NaN eval")
