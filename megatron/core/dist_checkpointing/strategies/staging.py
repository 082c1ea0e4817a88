"""Reusable host buffers that async saves copy the state into, so training waits for the copy's launch only.

`HostStaging.stage(tensors)` returns one host tensor per input. The buffers are one host allocation, made
at the first save and sized to the state (bytes = the sum of the tensors' sizes), reused by later saves of
the same shapes and dtypes and freed by `free()` (or at exit). With CUDA they are page-locked (registered
with `cudaHostRegister`, exactly the state's size: torch's pinned allocator would round each request up to
a power of two) and CUDA tensors are copied by non-blocking copies on a side stream:

- the side stream first waits for the current stream, so the copies read the values as of the save;
- `copy_done` is recorded after the copies; whoever changes the saved tensors next (the optimizer step)
  must first call `make_current_stream_wait()` (GPU-side ordering, the host does not wait);
- the writer calls `wait_copy()` (host-side) before it reads the buffers, and `release()` when done.

CPU tensors, and every tensor when the buffers are not page-locked (``pin=False``), are copied with plain
copies while the caller waits. ``keep=False`` frees the buffers once the writer releases them (one
allocation per save, as a plain host copy would take).

Allocating and page-locking the buffers is the slow part of a first save (17 s for Llama-3-8B's 56 GB per GPU
at TP=2, measured on an H200 host): `reserve(nbytes)` does it in a background thread while training runs
(the training loop calls it after its first iteration, `bytes_for` sizing it as the save will), and the first
`stage` whose state fits takes those buffers, waiting only for what is left of the reservation.
"""
import atexit
import ctypes
import functools
import threading
import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch

_ALIGN = 512  # byte alignment of each tensor in the slab (any dtype's element size divides it)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class HostStaging:
    """Host copies of a list of tensors in one reusable allocation (page-locked when CUDA is in use).

    ``pin``: page-lock the buffers and copy CUDA tensors in the background (default: when CUDA is
    available); ``keep``: keep the buffers for the next save. One save at a time may use the buffers:
    `stage` refuses while the previous staging was not `release`d."""

    def __init__(self, pin: Optional[bool] = None, keep: bool = True):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.keep = keep
        self._slab: Optional[torch.Tensor] = None
        self._registered = False
        self._reserving: Optional[threading.Thread] = None
        self._reserved: Optional[Tuple[torch.Tensor, bool]] = None  # (slab, registered) made by `reserve`
        self.reserve_s: Optional[float] = None  # how long the background reservation took (None: none yet)
        self._layout: Optional[Tuple] = None
        self._views: List[torch.Tensor] = []
        self._stream = None
        self._in_use = False
        self._lock = threading.Lock()
        self.copy_done = None  # torch.cuda.Event recorded after the latest staging's device copies
        self._copy_start = None
        self._pending_wait = False  # the latest copy_done has not been waited for by the current stream yet
        # The latest `stage`, in seconds: alloc_s (only when the buffers were (re)allocated), launch_s (queuing
        # the background copies), sync_copy_s (the plain copies the caller waited for), writer_wait_s (what the
        # writer thread waited for the background copies); bytes staged.
        self.stats: Dict[str, float] = {}
        _LIVE.add(self)

    @staticmethod
    def bytes_for(tensors: List[torch.Tensor]) -> int:
        """Host bytes `stage(tensors)` allocates: each tensor's size, aligned."""
        return sum(_aligned(t.numel() * t.element_size()) for t in tensors)

    def reserve(self, nbytes: int) -> None:
        """Start allocating (and page-locking) ``nbytes`` of buffers in a background thread, for the next
        `stage` whose state fits in them. Does nothing without page-locking (``pin=False``: a pageable
        allocation is fast), when buffers already exist or a reservation is under way."""
        if not self.pin or nbytes <= 0 or self._slab is not None or self._reserving is not None:
            return

        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def work():
            start = time.perf_counter()
            try:
                if device is not None:  # this rank's device, not device 0 (a new thread's default)
                    torch.cuda.set_device(device)
                slab = torch.empty(nbytes, dtype=torch.uint8)
                # Touch every page first (torch's kernel runs without the GIL): page-locking then only pins pages
                # that exist. Measured on an H200 host, page-locking 56 GB through torch's binding held the GIL
                # for all of its 23 s, and training's next step waited as long.
                slab.zero_()
                self._reserved = (slab, self._register(slab))
            except Exception:  # out of host memory...: the first save allocates as without a reservation
                self._reserved = None
            self.reserve_s = time.perf_counter() - start

        self._reserving = threading.Thread(target=work, name="host-staging-reserve", daemon=True)
        self._reserving.start()

    def _take_reserved(self, total: int) -> Optional[Tuple[torch.Tensor, bool]]:
        """The reserved buffers when they hold ``total`` bytes (waiting for the reservation to finish), else
        None (a smaller reservation is given back)."""
        if self._reserving is None:
            return None
        self._reserving.join()
        reserved, self._reserving, self._reserved = self._reserved, None, None
        if reserved is None:
            return None
        if reserved[0].numel() < total or not reserved[1]:  # too small, or CUDA refused to page-lock it
            self._unregister(*reserved)
            return None
        return reserved

    @property
    def nbytes(self) -> int:
        """Host bytes the buffers hold now (0 before the first save and after `free`)."""
        return 0 if self._slab is None else self._slab.numel()

    def stage(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Host copies of ``tensors`` (same shapes, dtypes and memory format as ``tensor.to("cpu")`` gives, so
        a checkpoint written from them is the same bytes), valid after `wait_copy`."""
        with self._lock:
            if self._in_use:
                raise RuntimeError("HostStaging.stage: the buffers still hold the previous save; write it and call "
                                   "release() first (finalize the pending async save)")
            self._in_use = True
        try:
            return self._stage(tensors)
        except BaseException:
            self.release()
            raise

    def _stage(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        start = time.perf_counter()
        # The strides `.to("cpu")` would give: a dense permuted tensor keeps its order, others are contiguous.
        layout = tuple((tuple(t.shape), torch.empty_like(t, device="meta").stride(), t.dtype) for t in tensors)
        alloc_s = 0.0
        if layout != self._layout:
            self._allocate(layout)
            alloc_s = time.perf_counter() - start
        background = self.pin and any(t.is_cuda for t in tensors)
        sync = time.perf_counter()
        for dst, src in zip(self._views, tensors):
            if not (background and src.is_cuda):
                dst.copy_(src.detach())
        launch = time.perf_counter()
        self.copy_done = None
        if background:
            self._launch_device_copies([(d, s) for d, s in zip(self._views, tensors) if s.is_cuda])
        self.stats = {"alloc_s": alloc_s, "sync_copy_s": launch - sync, "launch_s": time.perf_counter() - launch,
                      "writer_wait_s": 0.0, "bytes": float(sum(t.numel() * t.element_size() for t in tensors))}
        return list(self._views)

    def _launch_device_copies(self, pairs) -> None:
        device = pairs[0][1].device
        current = torch.cuda.current_stream(device)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        self._stream.wait_stream(current)  # the copies read the values as of this point of training
        self._copy_start = torch.cuda.Event(enable_timing=True)
        self.copy_done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            self._copy_start.record()
            for dst, src in pairs:
                dst.copy_(src.detach(), non_blocking=True)
                # A temporary source (made while building the state dict) must not be reused by the
                # allocator for other work before the side stream has read it.
                src.record_stream(self._stream)
            self.copy_done.record()
        self._pending_wait = True

    def make_current_stream_wait(self) -> None:
        """Order the current CUDA stream's next work after the latest copies (no host wait). Call it before
        modifying any staged tensor in place; a no-op when nothing is pending."""
        if self._pending_wait and self.copy_done is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self.copy_done)
        self._pending_wait = False

    def wait_copy(self) -> None:
        """Block the calling thread until the latest copies are in the buffers (the writer calls this)."""
        if self.copy_done is not None:
            start = time.perf_counter()
            self.copy_done.synchronize()
            self.stats["writer_wait_s"] = self.stats.get("writer_wait_s", 0.0) + time.perf_counter() - start

    def copy_seconds(self) -> Optional[float]:
        """Device time of the latest copies (None on CPU or while they still run)."""
        if self.copy_done is None or not self.copy_done.query():
            return None
        return self._copy_start.elapsed_time(self.copy_done) / 1000.0

    def release(self) -> None:
        """The writer is done with the buffers; the next `stage` may reuse them (``keep=False``: they are freed)."""
        with self._lock:
            if not self.keep:
                self.free()
            self._in_use = False

    def free(self) -> None:
        """Give the host memory back (waits for pending copies first)."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
        self._views, self._layout, self.copy_done, self._pending_wait = [], None, None, False
        if self._slab is not None:
            self._unregister(self._slab, self._registered)
        self._slab, self._registered = None, False
        if self._reserving is not None:
            self._reserving.join()
            if self._reserved is not None:
                self._unregister(*self._reserved)
            self._reserving, self._reserved = None, None

    @staticmethod
    def _unregister(slab: torch.Tensor, registered: bool) -> None:
        if registered:
            torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())

    def _allocate(self, layout) -> None:
        sizes = [int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
                 for shape, _, dtype in layout]
        total = sum(_aligned(n) for n in sizes)
        reserved = self._take_reserved(total)
        self.free()
        if reserved is not None:
            self._slab, self._registered = reserved
        else:
            self._slab = torch.empty(max(total, 1), dtype=torch.uint8)
            if self.pin:
                self._pin_slab()
        # Each view has storage of exactly its own size: DCP's writer copies a tensor whose storage is larger
        # (a plain slice of the slab) before writing it.
        buf, views, offset = self._slab.numpy(), [], 0
        for (shape, stride, dtype), n in zip(layout, sizes):
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset) if n else \
                torch.empty(0, dtype=torch.uint8)
            views.append(raw.view(dtype).as_strided(shape, stride))
            offset += _aligned(n)
        self._views, self._layout = views, layout

    def _pin_slab(self) -> None:
        if self._register(self._slab):
            self._registered = True
            return
        # Registration refused (e.g. a locked-memory limit): torch's pinned allocator rounds the size up.
        self._slab = torch.empty(self._slab.numel(), dtype=torch.uint8, pin_memory=True)

    @staticmethod
    def _register(slab: torch.Tensor) -> bool:
        """Page-lock ``slab`` in place; False when CUDA refuses (the slab stays pageable)."""
        register = _host_register_releasing_the_gil()
        if register is not None:
            return int(register(slab.data_ptr(), slab.numel(), 0)) == 0
        return int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 0)) == 0


_LIVE: "weakref.WeakSet[HostStaging]" = weakref.WeakSet()
@functools.lru_cache(maxsize=None)
def _host_register_releasing_the_gil():
    """cudaHostRegister called through ctypes, which releases the GIL for the call (torch's binding keeps it,
    stalling every other Python thread while tens of GB are pinned), or None when the CUDA runtime library
    cannot be found in this process (looked up once)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    candidates = [None]  # the symbols already loaded globally (torch loads the CUDA runtime RTLD_GLOBAL)
    try:
        with open("/proc/self/maps") as maps:
            candidates += sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        pass
    for path in candidates:
        try:
            fn = ctypes.CDLL(path).cudaHostRegister
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint], ctypes.c_int
        return fn
    return None


@atexit.register
def _free_all() -> None:
    for staging in list(_LIVE):
        try:
            staging.free()
        except Exception:  # the CUDA context may already be gone at interpreter exit
            pass


def wait_for_staged_copies() -> None:
    """Make the current CUDA stream wait for every background copy still pending (no host wait). Called
    where training changes saved state in place (the optimizer step, the MoE expert-bias update), so that
    an async save's copy reads the values of the step it was taken at. Inside a CUDA graph capture it does
    nothing (an outside event cannot be waited on there): a caller replaying graphs that change saved state
    waits before the replay (train_step does)."""
    pending = [staging for staging in list(_LIVE) if staging._pending_wait]
    if not pending or torch.cuda.is_current_stream_capturing():
        return
    for staging in pending:
        staging.make_current_stream_wait()
