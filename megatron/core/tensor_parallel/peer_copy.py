"""TP transfers as copy-engine reads of the peers' memory, so they run beside a GEMM that fills every SM.

A NCCL send/receive is a kernel: behind a GEMM that occupies all SMs it waits for the GEMM's blocks to
retire, so the ring of ``overlap.py`` hides little on a GPU (one Llama-3-8B layer's linears at TP=2 on
H100s: 0-10% of the communication hidden). Here each TP rank owns a buffer in torch's symmetric memory
that every rank of the group maps; a transfer is ``copy_`` from a peer's buffer, a device-to-device
memcpy that the copy engines carry over NVLink without SMs.

Protocol, per operation on a group: (1) the compute stream writes this rank's outgoing rows into its slot
and waits for the side stream's earlier copies; (2) a symmetric-memory barrier: every rank's slot is
written; (3) the side stream copies the peers' slots (one event per peer) while the compute stream runs the
GEMM that needs no remote rows. Slots alternate between two halves of the buffer: a rank writes a half
again only after the next operation's barrier, which every peer reaches only after its copies of this
half finished (step 1), so no copy ever reads a half being rewritten.
"""
import torch
import torch.distributed as dist

_STATE = {"off": None}  # None: usable; a string: why peer copies are off in this process
_WORKSPACES = {}  # group name -> _Workspace
_RETIRED = []  # outgrown workspaces: kept, since a peer's queued copy may still name their memory
_ALIGN = 256


def disable(reason: str) -> None:
    """Use the NCCL ring from now on in this process (``reason`` is what ``unavailable()`` reports)."""
    _STATE["off"] = reason


def unavailable():
    """Why peer copies are off in this process, or None."""
    return _STATE["off"]


class _Workspace:
    """Two slots of symmetric memory for one TP group, the side stream and the slot counter."""

    def __init__(self, group, slot_bytes, device):
        from torch.distributed import _symmetric_memory as symm  # lazy: only CUDA TP groups with the overlap use it
        self.group, self.slot_bytes = group, slot_bytes
        self.buffer = symm.empty(2 * slot_bytes, dtype=torch.uint8, device=device)
        self.handle = symm.rendezvous(self.buffer, group)
        self.rank, self.size = self.handle.rank, self.handle.world_size
        self.stream = torch.cuda.Stream(device=device)
        self.count = 0
        self.side_done = None  # event after the side stream's last copy

    def begin(self, nbytes):
        """Start an operation: (this rank's slot as bytes, a function giving a peer's slot view)."""
        slot = self.count % 2
        self.count += 1
        offset = slot * self.slot_bytes

        def peer(rank, shape, dtype):
            return self.handle.get_buffer(rank, shape, dtype, offset // dtype.itemsize)
        return self.buffer[offset:offset + nbytes], peer

    def exchange(self):
        """Barrier after this rank's slot is written and its earlier copies are done; the side stream then
        follows the compute stream."""
        current = torch.cuda.current_stream()
        if self.side_done is not None:
            current.wait_event(self.side_done)
        self.handle.barrier(channel=0)
        self.stream.wait_stream(current)

    def copy(self, dst, src):
        """dst <- src on the side stream; returns the event the consumer waits on."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.side_done = done
        return done


def workspace(group, nbytes, device):
    """The group's workspace with slots of at least ``nbytes``, or None where peer copies are unavailable
    (not CUDA, not NCCL, no symmetric memory, no peer access, or during CUDA-graph capture)."""
    if _STATE["off"] or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    if dist.get_backend(group) != "nccl":
        return None
    name = group.group_name
    ws = _WORKSPACES.get(name)
    if ws is not None and ws.slot_bytes >= nbytes:
        return ws
    # Every rank of the group asks for the same sizes in the same order, so all grow together.
    slot = -(-max(nbytes, 2 * ws.slot_bytes if ws is not None else 0) // _ALIGN) * _ALIGN
    try:
        if ws is not None:
            torch.cuda.current_stream().wait_stream(ws.stream)
            _RETIRED.append(ws)
        _WORKSPACES[name] = ws = _Workspace(group, slot, device)
    except Exception as e:  # noqa: BLE001  (any failure: the NCCL ring serves instead)
        _STATE["off"] = f"{type(e).__name__}: {str(e)[:200]}"
        if dist.get_rank() == 0:
            print(f"--tp-comm-overlap: peer copies unavailable ({_STATE['off']}); using the NCCL ring, which "
                  "hides less of the communication on GPUs", flush=True)
        return None
    return ws


def _rows(t, i, m):
    return t[i * m:(i + 1) * m]


def all_gather_mm(x, mat, group):
    """(all_gather(x) @ mat, all_gather(x)) along dim 0 of ``x`` [m, ..., k], or None if unavailable.

    This rank's GEMM block runs while the copy engines bring the peers' blocks; each peer's block is
    multiplied as soon as it has arrived."""
    x = x.contiguous()
    started = _gather(x, group)
    if started is None:
        return None
    total, arrived, r = started
    m = x.size(0)
    out = x.new_empty((total.size(0),) + tuple(x.shape[1:-1]) + (mat.size(-1),))
    _mm(x, mat, _rows(out, r, m))
    for c, done in arrived.items():  # ring order from the next rank
        torch.cuda.current_stream().wait_event(done)
        _mm(_rows(total, c, m), mat, _rows(out, c, m))
    return out, total


def mm_reduce_scatter(x, mat, group):
    """reduce_scatter(x @ mat) along dim 0: x [n*m, ..., k] -> [m, ..., mat_out], or None if unavailable.

    The partial products of the peers' blocks go into this rank's slot first; while the copy engines bring
    the peers' partials of this rank's block, its own block's GEMM runs; then the partials are added."""
    finish = mm_reduce_scatter_start(x, mat, group)
    return finish() if finish is not None else None


def mm_reduce_scatter_start(x, mat, group):
    """Start reduce_scatter(x @ mat) along dim 0 as ``mm_reduce_scatter`` does, with the adds left to the
    returned ``finish()``: work the caller issues before calling it (the column linear's weight-gradient
    GEMM) also runs beside the copies. The peers' blocks' products are written straight into the slot, so
    nothing is staged by a copy. None if unavailable."""
    n_rows = x.size(0)
    out_shape = tuple(x.shape[1:-1]) + (mat.size(-1),)
    nbytes = n_rows * _numel(out_shape) * x.element_size()  # a slot of n blocks; this rank's stays unused
    ws = workspace(group, nbytes, x.device)
    if ws is None:
        return None
    r, n = ws.rank, ws.size
    m = n_rows // n
    if m * n != n_rows:
        raise ValueError(f"sequence length {n_rows} is not divisible by the TP size {n}")
    block_shape = (m,) + out_shape
    mine, peer = ws.begin(nbytes)
    slots = mine.view(x.dtype).view((n,) + block_shape)  # slots[c]: this rank's partial of block c
    for c in range(n):
        if c != r:
            _mm(_rows(x, c, m), mat, slots[c])
    ws.exchange()
    recv = x.new_empty((n - 1,) + block_shape)
    arrived = [ws.copy(recv[i], peer(c, (n,) + block_shape, x.dtype)[r])
               for i, c in enumerate(c for c in range(n) if c != r)]
    own = x.new_empty(block_shape)
    _mm(_rows(x, r, m), mat, own)
    return lambda: _add_arrived(own, recv, arrived)


def all_gather_start(x, group):
    """Start all_gather(x) along dim 0 on the copy engines: (total, wait) with ``wait()`` making the current
    stream wait for it, or None if unavailable. Meant to run behind a GEMM issued before ``wait()``."""
    started = _gather(x.contiguous(), group)
    if started is None:
        return None
    total, arrived, _ = started

    def wait():
        for e in arrived.values():
            torch.cuda.current_stream().wait_event(e)
    return total, wait


def _gather(x, group):
    """Stage ``x`` (contiguous [m, ...]) and start the peers' copies: (total [n*m, ...], {peer: its copy's
    event} in ring order from the next rank, this rank), or None if unavailable.

    ``total`` is this operation's slot itself: this rank's rows are staged into their place in it, which the
    peers read, and the peers' rows are copied into theirs. One device-local copy per gather instead of two
    (staging, then this rank's rows into a separate gathered tensor: ~2% of a TP=2 Llama-3-8B step's GPU
    time as copies no kernel ran beside). The price is its lifetime: the slot is written again by the
    group's operation after the next, so a caller uses ``total`` before it starts another two (each
    linear's backward does; the forward drops it)."""
    m, r_shape, n = x.size(0), tuple(x.shape[1:]), dist.get_world_size(group)
    nbytes = n * x.numel() * x.element_size()
    ws = workspace(group, nbytes, x.device)
    if ws is None:
        return None
    r = ws.rank
    mine, peer = ws.begin(nbytes)
    shape = (n * m,) + r_shape
    total = mine.view(x.dtype).view(shape)
    _rows(total, r, m).copy_(x)
    ws.exchange()
    arrived = {c: ws.copy(_rows(total, c, m), _rows(peer(c, shape, x.dtype), c, m))
               for c in ((r + i) % n for i in range(1, n))}
    return total, arrived, r


def reduce_scatter_start(x, group):
    """Start reduce_scatter(x) along dim 0 (x [n*m, ...]) on the copy engines: (finish) where ``finish()``
    returns the [m, ...] sum, or None if unavailable."""
    x = x.contiguous()
    ws = workspace(group, x.numel() * x.element_size(), x.device)
    if ws is None:
        return None
    r, n = ws.rank, ws.size
    m = x.size(0) // n
    if m * n != x.size(0):
        raise ValueError(f"sequence length {x.size(0)} is not divisible by the TP size {n}")
    mine, peer = ws.begin(x.numel() * x.element_size())
    staged = mine.view(x.dtype).view(x.shape)
    for c in range(n):
        if c != r:  # peer c reads block c of it
            _rows(staged, c, m).copy_(_rows(x, c, m))
    ws.exchange()
    block = (m,) + tuple(x.shape[1:])
    recv = x.new_empty((n - 1,) + block)
    events = [ws.copy(recv[i], _rows(peer(c, x.shape, x.dtype), r, m))
              for i, c in enumerate(c for c in range(n) if c != r)]

    def finish():
        return _add_arrived(_rows(x, r, m), recv, events)
    return finish


def _add_arrived(own, recv, events):
    """own + recv[0] + recv[1] + ..., each added once its copy's event has passed; the first add writes a new
    tensor (no copy of ``own`` first), the rest add in place, in the order of the ring."""
    out = None
    for i, e in enumerate(events):
        torch.cuda.current_stream().wait_event(e)
        out = own + recv[i] if out is None else out.add_(recv[i])
    return out if out is not None else own.clone()


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _mm(a, mat, out):
    """out = a @ mat over the last dim, written in place (``out`` a contiguous row block)."""
    torch.mm(a.reshape(-1, a.size(-1)), mat, out=out.view(-1, mat.size(-1)))
