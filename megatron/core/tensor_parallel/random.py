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


def get_all_rng_states() -> Dict[str, torch.Tensor]:
    """The tracker's named generator states (what a CUDA graph capturing ``fork`` must register)."""
    return _CUDA_RNG_STATE_TRACKER.states_


def initialize_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                           use_cudagraphable_rng: bool = False, force_reset: bool = False) -> None:
    """Megatron creates its tracker here on first use; ours exists from import. An uninitialized tracker
    (no states yet), or any with ``force_reset``, is emptied and set graph-safe or not."""
    if use_te_rng_tracker or inference_rng_tracker:
        raise NotImplementedError("initialize_rng_tracker: the Transformer Engine and inference RNG trackers "
                                  "are not supported; leave use_te_rng_tracker / inference_rng_tracker False")
    tracker = _CUDA_RNG_STATE_TRACKER
    if force_reset or not tracker.is_initialized():
        tracker.reset()
        tracker.set_graph_safe(use_cudagraphable_rng)


def convert_cuda_rng_state(state, to_graphable: bool = False):
    """A generator-state tensor -> a graph-safe generator-state object (`to_graphable`), or back."""
    if not isinstance(state, (torch.Tensor, torch.Generator)):
        raise ValueError(f"convert_cuda_rng_state: expected a state tensor or torch.Generator, got {type(state)}")
    if not to_graphable:
        return state.get_state() if isinstance(state, torch.Generator) else state
    if isinstance(state, torch.Generator):
        return state
    if not torch.cuda.is_available():
        raise RuntimeError("convert_cuda_rng_state(to_graphable=True): graph-safe RNG states need a CUDA device")
    generator = _default_cuda_generator().clone_state()
    generator.set_state(state)
    return generator


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker) -> bool:
    """True when the tracker keeps graph-safe generator objects (use_cudagraphable_rng)."""
    return bool(getattr(cuda_rng_tracker, "graph_safe", False)
                or getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_gtp_remat_rng_tracker_name(is_expert: bool = False) -> str:
    """Name of Megatron's weight-rematerialisation (generalized TP) init RNG state. As in Megatron, the
    state exists only when that axis is larger than 1, which it never is here (gtp_remat is not
    implemented), so forking it raises."""
    return "egtp-remat-rng" if is_expert else "gtp-remat-rng"


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                    use_cudagraphable_rng: bool = False, tp_rank: Optional[int] = None,
                                    ep_rank: Optional[int] = None, etp_rank: Optional[int] = None,
                                    force_reset_rng: bool = False) -> None:
    """Seed the default device generator with ``seed`` and the tracker's data-parallel / TP / expert states.

    Data-parallel state: seed (same on every rank); TP state: seed + 2718 + tp_rank; expert state:
    seed + 1024 + 100 * ep_rank + expert_tp_rank. Ranks default to parallel_state's (pass them to seed
    without process groups).
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
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
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


_IS_CHECKPOINTING = False


@contextlib.contextmanager
def _checkpointing():
    global _IS_CHECKPOINTING
    previous, _IS_CHECKPOINTING = _IS_CHECKPOINTING, True
    try:
        yield
    finally:
        _IS_CHECKPOINTING = previous


def is_checkpointing() -> bool:
    """True while a recomputed function runs: its no-grad forward and its recompute in backward."""
    return _IS_CHECKPOINTING


class CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without saving activations; recompute it in backward under the same RNG states."""

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        if distribute_saved_activations:
            raise NotImplementedError("--distribute-saved-activations is not supported; drop the flag")
        ctx.run_function = run_function
        ctx.rng_states = _capture_rng()
        with torch.no_grad(), _checkpointing():
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
        with torch.enable_grad(), _checkpointing():
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


def _detached(args):
    return tuple(a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args)


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Forward of CheckpointWithoutOutput: runs ``run_function`` without a graph and keeps its inputs.
    Backward back-propagates through the graph that the recompute hook built."""

    @staticmethod
    def forward(ctx, run_function, checkpoint_without_output_obj, *args):
        with torch.no_grad(), _checkpointing():
            outputs = run_function(*args)
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        ctx.non_tensors = [None if torch.is_tensor(a) else a for a in args]
        ctx.recomputed = None  # (inputs, outputs), set by the recompute hook
        checkpoint_without_output_obj.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.recomputed is None:
            raise RuntimeError("CheckpointWithoutOutput: backward reached the checkpointed function before its "
                               "recompute ran; call discard_output_and_register_recompute(hook_tensor) with a "
                               "tensor whose gradient is computed first")
        inputs, outputs = ctx.recomputed
        ctx.recomputed = None
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(i.grad if torch.is_tensor(i) else None for i in inputs)


class CheckpointWithoutOutput:
    """Recompute whose outputs are freed too, not only its intermediates.

    ``out = ckpt.checkpoint(fn, *args)``; once the next op has consumed ``out`` (and saved it for its own
    backward), ``ckpt.discard_output_and_register_recompute(next_out)`` frees ``out``'s storage and
    recomputes it, under the forward's RNG states, when the gradient of ``next_out`` is computed,
    before the next op's backward reads it. `fp8` has no effect here: the recompute runs the same code,
    FP8 included."""

    def __init__(self, fp8=False):
        self.fp8 = fp8 is not None
        self.run_function, self.rng_states, self.ctx, self.outputs = None, None, None, None

    def checkpoint(self, run_function, *args):
        self.run_function = run_function
        self.rng_states = _capture_rng()
        outputs = CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        return outputs

    def _recompute(self, _):
        if self.ctx is None:
            return  # already recomputed
        saved = iter(self.ctx.saved_tensors)
        inputs = _detached([next(saved) if a is None else a for a in self.ctx.non_tensors])
        now = _capture_rng()
        _restore_rng(self.rng_states)
        try:
            with torch.enable_grad(), _checkpointing():
                outputs = self.run_function(*inputs)
        finally:
            _restore_rng(now)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        # Refill the freed storages in place through `.data`, which does not bump the version counter,
        # so the consumers that saved these tensors for backward accept them.
        for old, new in zip(self.outputs, outputs):
            old.untyped_storage().resize_(old.numel() * old.element_size())
            old.data.copy_(new.detach())
        self.ctx.recomputed = (inputs, outputs)
        self.ctx, self.outputs, self.run_function, self.rng_states = None, None, None, None

    def discard_output_and_register_recompute(self, hook_tensor):
        """Free the outputs' storage (their shapes stay) and recompute them when ``hook_tensor``'s
        gradient is computed."""
        for out in self.outputs:
            if out.storage_offset() != 0 or not out.is_contiguous():
                raise ValueError("CheckpointWithoutOutput: outputs must be contiguous tensors that own their "
                                 "storage to be discarded")
            out.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)
