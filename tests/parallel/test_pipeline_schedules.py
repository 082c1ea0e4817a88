"""Schedules on a small stage-aware model: every pipeline layout reproduces the single-process loss
and gradients bitwise (fp32 on CPU, one thread: each layer runs the same ops on the same micro-batch and
accumulates its grads over micro-batches in the same order). That holds for the interleaved schedule
with its p2p synchronous, overlapped in the steady phase (overlap_p2p_comm) and overlapped everywhere
(overlap_p2p_comm_warmup_flush), and those runs are also compared with each other."""
from dataclasses import dataclass

import torch

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.utils import make_plan
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


class RecordingCommunicator(P2PCommunicator):
    """Keeps every handle of an overlapped exchange; ``forward_step`` counts those still in flight when a
    forward starts."""

    def __init__(self, *args):
        super().__init__(*args)
        self.handles, self.most_in_flight = [], 0

    def communicate_async(self, **kwargs):
        recv_prev, recv_next, handle = super().communicate_async(**kwargs)
        self.handles.append(handle)
        return recv_prev, recv_next, handle

    def forward_step(self, data_iterator, model):
        self.most_in_flight = max(self.most_in_flight, sum(not h.done for h in self.handles))
        return forward_step_func(data_iterator, model)


# p2p modes of the interleaved schedule: the batched synchronous exchange, overlapped in the steady phase
# (Megatron's default with virtual stages), overlapped in every phase (--overlap-p2p-communication-warmup-flush).
P2P_MODES = {"sync": {}, "overlap": {"overlap_p2p_comm": True, "batch_p2p_comm": False},
             "overlap_all": {"overlap_p2p_comm": True, "batch_p2p_comm": False,
                             "overlap_p2p_comm_warmup_flush": True}}


def _run(pp, chunks, n_mb, forward_only=False, dealloc=False, group=None, p2p="sync"):
    """One schedule run checked against the single-process reference; returns the timer names and the
    last stage's losses and every chunk's grads (for the exact comparison of p2p modes). ``group``: the
    interleaved schedule's micro-batch group size (--microbatch-group-size-per-virtual-pipeline-stage)."""
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
                       finalize_model_grads_func=lambda m, n: calls["finalize"].append(n),
                       microbatch_group_size_per_vp_stage=group, **P2P_MODES[p2p])
    comm = RecordingCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    model, ids = [], []
    for c in range(chunks):
        v = c * pp + rank
        ids.append(list(range(v * per, (v + 1) * per)))
        model.append(ToyStage(config, ids[-1], v == 0))
    iters = [iter(_batches(n_mb)) for _ in range(chunks)]
    dicts = get_forward_backward_func()(
        forward_step_func=comm.forward_step, data_iterator=iters if chunks > 1 else iters[0],
        model=model if chunks > 1 else model[0], num_microbatches=n_mb, seq_length=S,
        micro_batch_size=B, forward_only=forward_only, p2p_communicator=comm if pp > 1 else None)
    # Every overlapped request was waited on before the schedule returned; the sync mode posts none.
    assert all(h.done for h in comm.handles) and bool(comm.handles) == (p2p != "sync")
    # Overlapped: on some rank an exchange is still in flight while a forward computes. Without
    # overlap_p2p_comm_warmup_flush only steady calls (a forward and a backward) overlap; forward-only runs
    # and runs with too few micro-batches have none.
    plans = [make_plan(pp, r, n_mb, chunks, group or pp, forward_only) for r in range(pp)] if chunks > 1 else []
    steady = any(p.forward_at(c) and p.backward_at(c) for p in plans for c in range(p.num_calls))
    most = torch.tensor(comm.most_in_flight)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    assert (most > 0) == (p2p == "overlap_all" or (p2p == "overlap" and steady)), (p2p, most)
    ref_dicts, ref_grads = reference(n_mb)
    last = rank == pp - 1
    assert len(dicts) == (n_mb if last else 0)
    for d, r in zip(dicts, ref_dicts):
        torch.testing.assert_close(d["lm loss"], r["lm loss"], rtol=0, atol=0)
    for c, m in enumerate(model):
        for i, layer in zip(ids[c], m.layers):
            if forward_only:
                assert layer.weight.grad is None
            else:
                torch.testing.assert_close(layer.weight.grad, ref_grads[i], rtol=0, atol=0)
    assert calls["finalize"] == ([] if forward_only else [None])
    grads = [layer.weight.grad for m in model for layer in m.layers]
    return config.timers.names, ([d["lm loss"] for d in dicts], grads)


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
        return set(), None
    raise AssertionError("interleaved schedule accepted 1 micro-batch on 2 stages")


def _run_cases(cases):
    """Several schedule runs in one set of processes (spawning ranks dominates the cost). A case whose
    last item is a list of p2p modes runs once per mode; the modes must agree bitwise."""
    names = set()
    for case in cases:
        if case == "too_few":
            names |= _too_few_microbatches()[0]
            parallel_state.destroy_model_parallel()
            continue
        modes = case[-1] if isinstance(case[-1], list) else ["sync"]
        case = case[:-1] if isinstance(case[-1], list) else case
        results = []
        for mode in modes:
            run_names, result = _run(*case, p2p=mode)
            names |= run_names
            results.append(result)
            parallel_state.destroy_model_parallel()
        for mode, (losses, grads) in zip(modes[1:], results[1:]):
            torch.testing.assert_close(losses, results[0][0], rtol=0, atol=0, msg=lambda m: f"{case} {mode}: {m}")
            torch.testing.assert_close(grads, results[0][1], rtol=0, atol=0, msg=lambda m: f"{case} {mode}: {m}")
    return names


ALL_P2P = ["sync", "overlap", "overlap_all"]


def test_two_stage_layouts():
    # (pp, chunks, micro-batches, forward_only, deallocate_pipeline_outputs[, micro-batch group][, p2p modes]);
    # pp=1 runs as DP=2
    cases = [(2, 1, 4), (2, 2, 4, False, False, ALL_P2P), (2, 2, 8, False, False, 4, ["sync", "overlap"]),
             (2, 1, 3, True), (2, 1, 3, False, True),
             (2, 2, 2, False, True, ALL_P2P), (2, 2, 4, True, False, ALL_P2P), (1, 1, 3), (1, 1, 2, True),
             "too_few"]
    names = set().union(*run_distributed(_run_cases, 2, cases))
    assert {"forward-backward", "forward-compute", "backward-compute", "forward-send-backward-recv",
            "backward-send-forward-recv", "forward-backward-send-forward-backward-recv",
            "forward-send-forward-recv", "backward-send-backward-recv",
            # where an overlapped exchange's time shows
            "forward-send-forward-recv-wait", "backward-send-backward-recv-wait"} <= names


def test_four_stage_layouts():
    run_distributed(_run_cases, 4, [(4, 1, 6), (4, 2, 4, False, False, ALL_P2P),
                                    (4, 2, 8, False, True, ALL_P2P), (4, 2, 4, True, False, ALL_P2P)])
