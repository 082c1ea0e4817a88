"""The overlapped schedule's held AccumulateGrad nodes: made once per step (on CUDA inside the accumulation
stream), they are the nodes every micro-batch's graph accumulates through, frozen parameters have none, and
without the hold a freed graph's node is gone (so the hold, not chance, decides where accumulation runs)."""
import contextlib

import torch

from megatron.core.pipeline_parallel.combined_1f1b import _hold_accumulators


def _accumulators(loss):
    """Every AccumulateGrad node the graph of ``loss`` reaches."""
    found, stack, seen = [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "AccumulateGrad":
            found.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[1].bias.requires_grad_(False)
    return model


def test_every_micro_batch_accumulates_through_the_held_nodes():
    model, x = _model(), torch.randn(3, 4)
    held = _hold_accumulators(model, contextlib.nullcontext())
    assert len(held) == 3  # the frozen bias has none
    for _ in range(2):  # two micro-batches, the first graph freed before the second is built
        loss = model(x).sum()
        assert {id(n) for n in _accumulators(loss)} == {id(n) for n in held}
        loss.backward()
        del loss
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_without_the_hold_a_freed_graphs_node_is_made_again():
    model, x = _model(), torch.randn(3, 4)
    loss = model(x).sum()
    for node in _accumulators(loss):
        node.metadata["first graph"] = True  # lives with the C++ node
    del loss, node  # no reference to the graph or its nodes is left
    assert not any("first graph" in n.metadata for n in _accumulators(model(x).sum()))  # new nodes

    held = _hold_accumulators(model, contextlib.nullcontext())
    for node in held:
        node.metadata["held"] = True
    loss = model(x).sum()
    del loss
    assert all("held" in n.metadata for n in _accumulators(model(x).sum()))
