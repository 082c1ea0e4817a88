"""RNG state tracking for TP-consistent dropout, and activation recompute that replays it.

Replicated activations need the same dropout mask on every TP rank (default generator, same seed);
TP-split activations need different masks (the "model-parallel-rng" state, seed + 2718 + tp_rank).
On CPU the "CUDA" generator is the CPU default generator, so the same code paths run everywhere.
"""
import contextlib
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states; ``fork(name)`` runs a block under that state and saves its advance.

    Graph-safe mode (``use_cudagraphable_rng``, CUDA only) keeps each state as a generator-state object
    that ``fork`` swaps in by reference (``graphsafe_set_state``) instead of copying seed/offset bytes
    through the host, so a CUDA graph can capture the block: register `graph_safe_states()` with the
    graph and every replay draws fresh numbers. Both modes give the same numbers for the same seed.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        self.graph_safe = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()
        self.set_graph_safe(use_cudagraphable_rng)

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()

    def set_graph_safe(self, enabled: bool) -> None:
        if enabled and not torch.cuda.is_available():
            raise RuntimeError("graph-safe RNG states (CUDA graphs) need a CUDA device")
        if enabled != self.graph_safe:
            states = self.get_states()
            self.graph_safe = enabled
            self.states_ = {}
            self.set_states(states)

    def graph_safe_states(self) -> List:
        """The generator-state objects a CUDA graph capturing `fork` blocks must register."""
        return list(self.states_.values()) if self.graph_safe else []

    def get_states(self) -> Dict[str, torch.Tensor]:
        if self.graph_safe:
            return {k: v.get_state() for k, v in self.states_.items()}
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        if not self.graph_safe:
            self.states_ = {k: v.clone() for k, v in states.items()}
            return
        for k, v in states.items():  # in place: graphs registered these objects
            if k not in self.states_:
                self.states_[k] = _default_cuda_generator().clone_state()
            self.states_[k].set_state(v)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already registered")
        if name in self.states_:
            raise ValueError(f"RNG state '{name}' already exists")
        self.seeds_.add(seed)
        if self.graph_safe:
            state = _default_cuda_generator().clone_state()
            state.manual_seed(seed)
            self.states_[name] = state
            return
        saved = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_ and parallel_state.get_tensor_model_parallel_world_size() == 1:
            yield  # unseeded single-rank use: split and replicated activations coincide
            return
        if name not in self.states_:
            raise KeyError(f"RNG state '{name}' is not set; call model_parallel_cuda_manual_seed(seed) first")
        if self.graph_safe:
            generator = _default_cuda_generator()
            saved = generator.graphsafe_get_state()
            generator.graphsafe_set_state(self.states_[name])  # advances land in the tracked state
            try:
                yield
            finally:
                generator.graphsafe_set_state(saved)
            return
        saved = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(saved)


def _default_cuda_generator():
    return torch.cuda.default_generators[torch.cuda.current_device()]


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                         use_cudagraphable_rng: bool = False):
    """The process-wide tracker (graph-safe mode is chosen by model_parallel_cuda_manual_seed)."""
    if use_te_rng_tracker:
        raise NotImplementedError("--te-rng-tracker needs Transformer Engine, which is not supported")
    return _CUDA_RNG_STATE_TRACKER


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                    use_cudagraphable_rng: bool = False, tp_rank: Optional[int] = None,
                                    ep_rank: Optional[int] = None, etp_rank: Optional[int] = None,
                                    force_reset_rng: bool = False) -> None:
    """Seed the default device generator with ``seed`` and the tracker's TP / expert states.

    TP state: seed + 2718 + tp_rank; expert state: seed + 1024 + 100 * ep_rank + expert_tp_rank. Ranks
    default to parallel_state's (pass them to seed without process groups).
    """
    if te_rng_tracker:
        raise NotImplementedError("--te-rng-tracker needs Transformer Engine, which is not supported; drop the flag")
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = parallel_state.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = parallel_state.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.set_graph_safe(use_cudagraphable_rng)  # --cuda-graph-impl full_iteration
    _manual_seed(seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def _capture_rng():
    cpu = torch.get_rng_state()
    dev = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return cpu, dev, get_cuda_rng_tracker().get_states()


def _restore_rng(states):
    cpu, dev, tracker = states
    torch.set_rng_state(cpu)
    if dev is not None:
        torch.cuda.set_rng_state(dev)
    get_cuda_rng_tracker().set_states(tracker)


class CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without saving activations; recompute it in backward under the same RNG states."""

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        if distribute_saved_activations:
            raise NotImplementedError("--distribute-saved-activations is not supported; drop the flag")
        ctx.run_function = run_function
        ctx.rng_states = _capture_rng()
        with torch.no_grad():
            outputs = run_function(*args)
        tensors = [a if torch.is_tensor(a) else None for a in args]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[t for t in tensors if t is not None])
        ctx.is_tensor = [t is not None for t in tensors]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        inputs = []
        for is_t, other in zip(ctx.is_tensor, ctx.others):
            if is_t:
                t = next(saved)
                inputs.append(t.detach().requires_grad_(t.requires_grad))
            else:
                inputs.append(other)
        now = _capture_rng()
        _restore_rng(ctx.rng_states)
        with torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        _restore_rng(now)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        in_grads = tuple(i.grad if torch.is_tensor(i) else None for i in inputs)
        return (None, None) + in_grads


def checkpoint(function, distribute_saved_activations: bool, *args):
    """Activation recompute of ``function(*args)`` (Megatron's ``tensor_parallel.checkpoint``)."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
