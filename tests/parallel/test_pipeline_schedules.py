"""Schedules on a small stage-aware model: every pipeline layout reproduces the single-process loss
and gradients. fp32 on CPU; the only differences come from summation order, so 1e-5 relative."""
from dataclasses import dataclass

import torch

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.parallel.dist_utils import run_distributed

S, B, H, LAYERS = 4, 2, 8, 8


@dataclass
class ToyConfig(ModelParallelConfig):
    hidden_size: int = H


class ToyStage(torch.nn.Module):
    """Layers ``layer_ids`` of a tanh-MLP stack; the first stage reads the batch, others the
    tensor received from the previous stage."""

    def __init__(self, config, layer_ids, first):
        super().__init__()
        self.config, self.first, self.input_tensor = config, first, None
        self.layers = torch.nn.ModuleList(_layer(i) for i in layer_ids)

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        h = x if self.first else self.input_tensor  # [s, b, h]
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def _layer(i):
    torch.manual_seed(100 + i)
    return torch.nn.Linear(H, H)


def _batches(n):
    g = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(S, B, H, generator=g), "y": torch.randn(S, B, H, generator=g)}
            for _ in range(n)]


def forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["x"])

    def loss_func(output):
        err = ((output - batch["y"]) ** 2).sum()
        n = torch.tensor(output.numel())
        return err, n, {"lm loss": torch.stack([err.detach(), n.float()])}

    return out, loss_func


def reference(n_mb):
    """Loss dicts and per-layer grads of the whole stack on one process."""
    stage = ToyStage(ToyConfig(), range(LAYERS), True)
    dicts = []
    for batch in _batches(n_mb):
        out, loss_func = forward_step_func(iter([batch]), stage)
        err, n, d = loss_func(out)
        (err / n / n_mb).backward()
        dicts.append(d)
    return dicts, {i: l.weight.grad.clone() for i, l in enumerate(stage.layers)}


class RecordingTimers:
    def __init__(self):
        self.names = set()

    def __call__(self, name, log_level=None):
        self.names.add(name)
        return self

    def start(self, barrier=False):
        pass

    def stop(self, barrier=False):
        pass


def _run(pp, chunks, n_mb, forward_only=False, dealloc=False):
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
    rank, per = parallel_state.get_pipeline_model_parallel_rank(), LAYERS // (pp * chunks)
    calls = {"finalize": [], "no_sync": 0}

    class NoSync:
        def __enter__(self):
            calls["no_sync"] += 1

        def __exit__(self, *a):
            pass

    config = ToyConfig(pipeline_model_parallel_size=pp, deallocate_pipeline_outputs=dealloc,
                       timers=RecordingTimers(), no_sync_func=NoSync,
                       finalize_model_grads_func=lambda m, n: calls["finalize"].append(n))
    model, ids = [], []
    for c in range(chunks):
        v = c * pp + rank
        ids.append(list(range(v * per, (v + 1) * per)))
        model.append(ToyStage(config, ids[-1], v == 0))
    iters = [iter(_batches(n_mb)) for _ in range(chunks)]
    dicts = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=iters if chunks > 1 else iters[0],
        model=model if chunks > 1 else model[0], num_microbatches=n_mb, seq_length=S,
        micro_batch_size=B, forward_only=forward_only)
    ref_dicts, ref_grads = reference(n_mb)
    last = rank == pp - 1
    assert len(dicts) == (n_mb if last else 0)
    for d, r in zip(dicts, ref_dicts):
        torch.testing.assert_close(d["lm loss"], r["lm loss"], rtol=1e-5, atol=0)
    for c, m in enumerate(model):
        for i, layer in zip(ids[c], m.layers):
            if forward_only:
                assert layer.weight.grad is None
            else:
                torch.testing.assert_close(layer.weight.grad, ref_grads[i], rtol=1e-5, atol=1e-7)
    assert calls["finalize"] == ([] if forward_only else [None])
    return config.timers.names


def _too_few_microbatches():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=2)
    config = ToyConfig(pipeline_model_parallel_size=2)
    model = [ToyStage(config, [0], True), ToyStage(config, [1], False)]
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=[iter(_batches(1))] * 2, model=model,
            num_microbatches=1, seq_length=S, micro_batch_size=B)
    except ValueError as e:
        assert "num_microbatches (1)" in str(e) and "--global-batch-size" in str(e), e
        return set()
    raise AssertionError("interleaved schedule accepted 1 micro-batch on 2 stages")


def _run_cases(cases):
    """Several schedule runs in one set of processes (spawning ranks dominates the cost)."""
    names = set()
    for case in cases:
        names |= _too_few_microbatches() if case == "too_few" else _run(*case)
        parallel_state.destroy_model_parallel()
    return names


def test_two_stage_layouts():
    # (pp, chunks, micro-batches, forward_only, deallocate_pipeline_outputs); pp=1 runs as DP=2
    cases = [(2, 1, 4), (2, 2, 4), (2, 1, 3, True), (2, 1, 3, False, True), (2, 2, 2, False, True),
             (2, 2, 4, True), (1, 1, 3), (1, 1, 2, True), "too_few"]
    names = set().union(*run_distributed(_run_cases, 2, cases))
    assert {"forward-backward", "forward-compute", "backward-compute", "forward-send-backward-recv",
            "backward-send-forward-recv", "forward-backward-send-forward-backward-recv",
            "forward-send-forward-recv", "backward-send-backward-recv"} <= names


def test_four_stage_layouts():
    run_distributed(_run_cases, 4, [(4, 1, 6), (4, 2, 4), (4, 2, 8, False, True)])
