"""Point-to-point exchange of activations and gradients between adjacent pipeline stages.

Every exchange is one batch of isend/irecv (``torch.distributed.batch_isend_irecv``), which works on
gloo (CPU) and NCCL (GPU). ``communicate`` waits for its batch; ``communicate_async`` returns a
``P2PHandle`` instead, which the interleaved schedule waits on when it needs the tensors
(``--overlap-p2p-communication``). Shapes are known in advance from the config, so no shape handshake is needed:
``[s / CP (/ TP with sequence parallelism), micro_batch_size, hidden_size]``.

Ordering matters when the previous and the next stage are the same rank (PP=2 with virtual stages):
ops to one peer are matched in the order they are posted, so every batch is posted as
send-next, recv-prev, send-prev, recv-next. In each direction the activation then always travels
before the gradient on both ends of the link.
"""
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.utils import current_device
from megatron.core.utils import lazy_names

# Megatron's shape test, which the one-tensor communicator here does not need, resolved on first use.
__getattr__ = lazy_names(__name__, {"is_single_shape": "megatron.core._compat.p2p_communication"})

Shape = Union[List[int], Tuple[int, ...], torch.Size]


def get_tensor_shape(config, seq_length: int, micro_batch_size: int) -> Tuple[int, int, int]:
    """Shape of the activation crossing a stage boundary: [s/CP (/TP with SP), b, h]."""
    seq = seq_length // getattr(config, "context_parallel_size", 1)
    if getattr(config, "sequence_parallel", False):
        seq = seq // config.tensor_model_parallel_size
    return (seq, micro_batch_size, config.hidden_size)


def get_pipeline_dtype(config) -> torch.dtype:
    """dtype of tensors sent between stages: config.pipeline_dtype, else the params dtype."""
    dtype = getattr(config, "pipeline_dtype", None)
    return dtype if dtype is not None else getattr(config, "params_dtype", torch.float32)


class _NullTimer:
    def start(self, barrier=False):
        pass

    def stop(self, barrier=False):
        pass


class P2PCommunicator:
    """Sends/receives between this rank and its neighbours in ``pp_group`` (a ring: the last
    stage's next is the first stage, which the interleaved schedule uses between virtual chunks).

    The first/last-stage checks of the public helpers (``recv_forward`` returns None on the first
    stage, ...) apply to the non-interleaved schedules; the interleaved schedule calls
    ``communicate`` with explicit flags because its first/last stage depends on the chunk.
    """

    def __init__(self, pp_group, config):
        self.pp_group = pp_group
        self.config = config
        ranks = dist.get_process_group_ranks(pp_group)
        self.rank = dist.get_rank(group=pp_group)
        self.world_size = len(ranks)
        self.next_rank = ranks[(self.rank + 1) % self.world_size]
        self.prev_rank = ranks[(self.rank - 1) % self.world_size]
        self.dtype = get_pipeline_dtype(config)
        if getattr(config, "variable_seq_lengths", False):
            raise NotImplementedError(
                "variable_seq_lengths: pipeline p2p with per-batch shapes is not supported; "
                "pad to --seq-length instead")

    @property
    def is_first_stage(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank == self.world_size - 1

    def _timer(self, name):
        timers = getattr(self.config, "timers", None)
        return timers(name, log_level=2) if timers is not None else _NullTimer()

    def _empty(self, shape: Shape, requires_grad: bool) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=self.dtype, device=current_device(),
                           requires_grad=requires_grad)

    def _post(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, batch):
        """Post one exchange; returns (from_prev, from_next, requests, the tensors the requests use)."""
        recv_prev_t = self._empty(tensor_shape, True) if recv_prev else None
        recv_next_t = self._empty(tensor_shape, False) if recv_next else None
        ops = []
        if tensor_send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._to_send(tensor_send_next), self.next_rank,
                                  self.pp_group))
        if recv_prev_t is not None:
            ops.append(dist.P2POp(dist.irecv, recv_prev_t, self.prev_rank, self.pp_group))
        if tensor_send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._to_send(tensor_send_prev), self.prev_rank,
                                  self.pp_group))
        if recv_next_t is not None:
            ops.append(dist.P2POp(dist.irecv, recv_next_t, self.next_rank, self.pp_group))
        reqs = []
        if ops:
            # batch=False posts the same ops one by one (same order, same result).
            reqs = dist.batch_isend_irecv(ops) if batch else [op.op(op.tensor, op.peer, op.group) for op in ops]
        return recv_prev_t, recv_next_t, reqs, [op.tensor for op in ops]

    def communicate(self, *, tensor_send_next: Optional[torch.Tensor],
                    tensor_send_prev: Optional[torch.Tensor], recv_prev: bool, recv_next: bool,
                    tensor_shape: Shape) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """One batched exchange with both neighbours; returns (from_prev, from_next).

        Tensors received from the previous stage are activations, so they require grad (the
        backward step reads their .grad); tensors from the next stage are output gradients.
        """
        # config.batch_p2p_comm=False posts the ops one by one.
        recv_prev_t, recv_next_t, reqs, _ = self._post(
            tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
            getattr(self.config, "batch_p2p_comm", True))
        # On NCCL, wait() makes the current stream wait for the exchange (the host does not): compute
        # queued after it reads the received tensors once they have arrived, and the host can go on
        # queueing. (Megatron adds a device-wide synchronize here, against a race of old PyTorch
        # versions; it stalls the host at every exchange and leaves the GPU idle while it refills.)
        for req in reqs:
            req.wait()
        return recv_prev_t, recv_next_t

    def communicate_async(self, *, tensor_send_next: Optional[torch.Tensor],
                          tensor_send_prev: Optional[torch.Tensor], recv_prev: bool, recv_next: bool,
                          tensor_shape: Shape, name: str = "p2p",
                          ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], "P2PHandle"]:
        """``communicate`` without the wait: returns (from_prev, from_next, handle). The received
        tensors hold data, and the sent ones may be freed or changed, only after ``handle.wait()``.

        Always one ``batch_isend_irecv`` (one NCCL group, whatever config.batch_p2p_comm says): ops
        posted one by one, each its own NCCL kernel in one stream, could wait on each other across
        ranks (a send to a rank that is itself still sending to us).
        """
        recv_prev_t, recv_next_t, reqs, tensors = self._post(
            tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, True)
        return recv_prev_t, recv_next_t, P2PHandle(self, name, reqs, tensors)

    def _to_send(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype != self.dtype:
            raise ValueError(
                f"pipeline_dtype: stage output is {tensor.dtype} but p2p buffers are {self.dtype}; "
                "set --fp16/--bf16 consistently (config.pipeline_dtype)")
        return tensor.detach().contiguous()

    def _timed(self, name, async_op=False, **kwargs):
        """Run (or, with ``async_op``, post) one exchange under the timer and profiler range ``name``."""
        timer = self._timer(name)
        timer.start()
        # A named range in profiler traces (NVTX under nsys): tools/trace_report.py tells the pipeline's
        # p2p from other sends and receives (the context-parallel ring) by it.
        with torch.profiler.record_function(f"p2p:{name}"):
            result = self.communicate_async(name=name, **kwargs) if async_op else self.communicate(**kwargs)
        timer.stop()
        return result

    # Non-interleaved helpers (stage-aware).
    def recv_forward(self, tensor_shape: Shape) -> Optional[torch.Tensor]:
        if self.is_first_stage:
            return None
        return self._timed("forward-recv", tensor_send_next=None, tensor_send_prev=None,
                           recv_prev=True, recv_next=False, tensor_shape=tensor_shape)[0]

    def recv_backward(self, tensor_shape: Shape) -> Optional[torch.Tensor]:
        if self.is_last_stage:
            return None
        return self._timed("backward-recv", tensor_send_next=None, tensor_send_prev=None,
                           recv_prev=False, recv_next=True, tensor_shape=tensor_shape)[1]

    def send_forward(self, output_tensor: Optional[torch.Tensor], tensor_shape: Shape = None):
        if self.is_last_stage or output_tensor is None:
            return
        self._timed("forward-send", tensor_send_next=output_tensor, tensor_send_prev=None,
                    recv_prev=False, recv_next=False, tensor_shape=tensor_shape)

    def send_backward(self, input_tensor_grad: Optional[torch.Tensor], tensor_shape: Shape = None):
        if self.is_first_stage or input_tensor_grad is None:
            return
        self._timed("backward-send", tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                    recv_prev=False, recv_next=False, tensor_shape=tensor_shape)

    def send_forward_recv_backward(self, output_tensor, tensor_shape: Shape):
        if self.is_last_stage:
            return None
        return self._timed("forward-send-backward-recv", tensor_send_next=output_tensor,
                           tensor_send_prev=None, recv_prev=False, recv_next=True,
                           tensor_shape=tensor_shape)[1]

    def send_backward_recv_forward(self, input_tensor_grad, tensor_shape: Shape):
        if self.is_first_stage:
            return None
        return self._timed("backward-send-forward-recv", tensor_send_next=None,
                           tensor_send_prev=input_tensor_grad, recv_prev=True, recv_next=False,
                           tensor_shape=tensor_shape)[0]

    # Interleaved helpers: the caller decides, per virtual chunk, what is sent and received.
    def send_forward_recv_forward(self, output_tensor, recv_prev: bool, tensor_shape: Shape):
        return self._timed("forward-send-forward-recv", tensor_send_next=output_tensor,
                           tensor_send_prev=None, recv_prev=recv_prev, recv_next=False,
                           tensor_shape=tensor_shape)[0]

    def send_backward_recv_backward(self, input_tensor_grad, recv_next: bool, tensor_shape: Shape):
        return self._timed("backward-send-backward-recv", tensor_send_next=None,
                           tensor_send_prev=input_tensor_grad, recv_prev=False,
                           recv_next=recv_next, tensor_shape=tensor_shape)[1]

    # Overlapped interleaved helpers: post one direction, return (received tensor or None, handle).
    def send_forward_recv_forward_async(self, output_tensor, recv_prev: bool, tensor_shape: Shape):
        from_prev, _, handle = self._timed("forward-send-forward-recv", async_op=True,
                                           tensor_send_next=output_tensor, tensor_send_prev=None,
                                           recv_prev=recv_prev, recv_next=False, tensor_shape=tensor_shape)
        return from_prev, handle

    def send_backward_recv_backward_async(self, input_tensor_grad, recv_next: bool, tensor_shape: Shape):
        _, from_next, handle = self._timed("backward-send-backward-recv", async_op=True,
                                           tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                                           recv_prev=False, recv_next=recv_next, tensor_shape=tensor_shape)
        return from_next, handle

    def send_forward_backward_recv_forward_backward(self, output_tensor, input_tensor_grad,
                                                    recv_prev: bool, recv_next: bool,
                                                    tensor_shape: Shape):
        return self._timed("forward-backward-send-forward-backward-recv",
                           tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad,
                           recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape)


class P2PHandle:
    """The requests of one posted exchange and the tensors they read or fill (kept alive until done).

    ``wait()`` is where an overlapped exchange's time shows: it runs under the timer and profiler range
    ``<name>-wait``. On NCCL it makes the current stream wait (the host goes on), on gloo the host waits.
    """

    def __init__(self, comm: P2PCommunicator, name: str, reqs, tensors):
        self.comm, self.name, self._reqs, self._tensors = comm, name, list(reqs), tensors

    @property
    def done(self) -> bool:
        """True once waited on (a handle with no requests is done from the start)."""
        return not self._reqs

    def wait(self) -> None:
        if not self._reqs:
            return
        timer = self.comm._timer(f"{self.name}-wait")
        timer.start()
        with torch.profiler.record_function(f"p2p:{self.name}-wait"):
            for req in self._reqs:
                req.wait()
        timer.stop()
        self._reqs, self._tensors = [], None


def default_communicator(config) -> P2PCommunicator:
    """Communicator on the registered pipeline group (megatron.core.parallel_state)."""
    return P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
