"""Profiling windows with Megatron's flags: a torch.profiler Chrome trace per rank, an nsys capture range,
and a CUDA memory snapshot.

- ``--profile --use-pytorch-profiler``: iterations ``[--profile-step-start, --profile-step-end)`` (counted
  as the log counts them, from 0 before the first step) are recorded by ``torch.profiler`` on each rank of
  ``--profile-ranks`` and written as ``<--tensorboard-dir>/rank<R>.<time>.pt.trace.json`` (TensorBoard's
  profiler plugin and chrome://tracing / Perfetto read it; ``tools/pipeline_timeline.py`` too).
- ``--profile`` alone: the same window is an nsys capture range (``cudaProfilerStart/Stop``; run under
  ``nsys profile --capture-range=cudaProfilerApi``) with ``emit_nvtx`` on, so each ``record_function``
  range of the training step (forward, backward, optimizer, the collectives) is an NVTX range.
- ``--record-memory-history``: CUDA allocations are recorded from the start of training and a snapshot
  is written to ``--memory-snapshot-path`` (https://pytorch.org/memory_viz) on the last rank, at the end
  of the profiling window when ``--profile`` is set, else after the first logged iteration.

The ranges themselves are named in the training step with ``torch.profiler.record_function``: without a
profiler running they cost one check per range.
"""
import json
import os
import socket
from typing import Optional

import torch

from megatron.core import parallel_state

# Names the step's ranges carry in traces; tests and tools/pipeline_timeline.py look for them.
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"


def parallel_layout() -> dict:
    """This rank's coordinates in the parallel layout ({} before the model-parallel groups exist)."""
    ps = parallel_state
    if not ps.model_parallel_is_initialized():
        return {}
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "tp_size": ps.get_tensor_model_parallel_world_size(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp_size": ps.get_pipeline_model_parallel_world_size(),
            "vp_size": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            "cp_rank": ps.get_context_parallel_rank(), "cp_size": ps.get_context_parallel_world_size(),
            "dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size()}


class ProfilingWindow:
    """Starts and stops the profilers of one rank around the training loop's iterations."""

    def __init__(self, args, rank: int):
        in_ranks = rank in (args.profile_ranks or [0])
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.torch_trace = bool(args.profile and args.use_pytorch_profiler and in_ranks)
        self.nsys_range = bool(args.profile and not args.use_pytorch_profiler and in_ranks)
        self.trace_dir = args.tensorboard_dir
        self.collect_shapes = args.pytorch_profiler_collect_shapes or args.record_shapes
        self.whole_run_nvtx = bool(args.nvtx_ranges)
        self.collect_stack = args.pytorch_profiler_collect_callstack
        self.rank = rank
        self.memory_path = args.memory_snapshot_path if args.record_memory_history else None
        self.memory_dump_at = self.end if args.profile else args.log_interval
        self.is_last_rank = rank == torch.distributed.get_world_size() - 1 if torch.distributed.is_initialized() \
            else True
        self._profiler: Optional[torch.profiler.profile] = None
        self._nvtx = None

    def begin_training(self) -> None:
        if self.memory_path is not None:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if self.whole_run_nvtx:
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=self.collect_shapes)
            self._nvtx.__enter__()

    def before_step(self, iteration: int) -> None:
        """``iteration`` steps are done; the next one is about to run."""
        if iteration != self.start:
            return
        if self.torch_trace:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=self.collect_shapes,
                                                    with_stack=self.collect_stack)
            self._profiler.start()
            # The rank's place in the layout, for tools/trace_report.py (pipeline stage of each trace).
            self._profiler.add_metadata_json("megatron_parallel", json.dumps(parallel_layout()))
        if self.nsys_range:
            torch.cuda.cudart().cudaProfilerStart()
            if self._nvtx is None:
                self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=self.collect_shapes)
                self._nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        """``iteration`` steps are done (the one just run included)."""
        if iteration == self.end:
            self._stop()
        if self.memory_path is not None and iteration == self.memory_dump_at and self.is_last_rank:
            directory = os.path.dirname(self.memory_path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            torch.cuda.memory._dump_snapshot(self.memory_path)
            print(f"[rank {self.rank}] CUDA memory snapshot written to {self.memory_path}", flush=True)

    def finish_training(self) -> None:
        """The loop ended (possibly inside the window): write what was recorded."""
        self._stop()
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None

    def _stop(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            os.makedirs(self.trace_dir, exist_ok=True)
            path = os.path.join(self.trace_dir, f"rank{self.rank}.{socket.gethostname()}.{os.getpid()}.pt.trace.json")
            self._profiler.export_chrome_trace(path)
            print(f"[rank {self.rank}] profiler trace of iterations {self.start}-{self.end} written to {path}",
                  flush=True)
            self._profiler = None
        if self.nsys_range and self._nvtx is not None:
            torch.cuda.cudart().cudaProfilerStop()
            if not self.whole_run_nvtx:
                self._nvtx.__exit__(None, None, None)
                self._nvtx = None
