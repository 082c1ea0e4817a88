"""Pipeline timeline and exposed communication of one rank, read from its torch.profiler Chrome trace.

The trace's time is split into compute (GPU: every kernel, copy or memset that is not NCCL's; CPU: the main
thread's operators), communication (GPU: NCCL kernels; CPU: the gloo ranges, on any thread) and idle, which
add up to the window. Communication is exposed where no compute runs at the same time. Each collective is
named by the host range it was launched under (``nccl:<op>`` / ``gloo:<op>``, and ``p2p:<kind>`` for the
pipeline's sends and receives, P2PCommunicator's ranges) or else by its kernel's name. Per iteration (the
span between optimizer steps) the schedule runs from the first forward to the end of the last backward; the
part of it in which this rank computes nothing is its bubble: waiting on a neighbour stage, exposed
communication and host gaps. On GPUs compute is placed by the kernels the ranges launched (correlation ids),
so a range's time is the device's, not the host's.
"""
from bisect import bisect_right
from typing import Dict, Iterable, List, Optional, Tuple

Span = Tuple[float, float]
PHASES = ("forward", "backward", "optimizer")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
PIPELINE_P2P = "pp_p2p"  # sends and receives between pipeline stages (under a p2p:* range)


def union(spans: Iterable[Span]) -> List[Span]:
    merged: List[List[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(spans: List[Span]) -> float:
    return sum(b - a for a, b in spans)


def intersect(u: List[Span], v: List[Span]) -> List[Span]:
    """Intersection of two unions (sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if a < b:
            out.append((a, b))
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return out


def minus(u: List[Span], v: List[Span]) -> float:
    """Length of u outside v."""
    return length(u) - length(intersect(u, v))


def comm_kind(name: str) -> str:
    """``nccl:_all_gather_base`` / ``gloo:all_reduce`` / ``ncclDevKernel_ReduceScatter_Sum_f32_RING_LL`` ->
    all_gather / all_reduce / reduce_scatter; sends and receives -> p2p."""
    n = name.split(":", 1)[-1].lower().replace("_", "")
    for key, kind in (("alltoall", "all_to_all"), ("allreduce", "all_reduce"), ("allgather", "all_gather"),
                      ("reducescatter", "reduce_scatter"), ("broadcast", "broadcast"), ("barrier", "barrier"),
                      ("sendrecv", "p2p"), ("send", "p2p"), ("recv", "p2p"), ("coalesced", "p2p")):
        if key in n:
            return kind
    return "other"


def _x(events, pred) -> List[dict]:
    return [e for e in events if e.get("ph") == "X" and "ts" in e and pred(e)]


def _span(e) -> Span:
    return (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))


class _Ranges:
    """Host ranges of one thread, to find the innermost one (by name filter) around a time."""

    def __init__(self, events: List[dict]):
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]

    def around(self, t: float, pred) -> Optional[dict]:
        best = None
        for e in self.events[:bisect_right(self.starts, t)]:
            if e["ts"] + e.get("dur", 0.0) >= t and pred(e["name"]) and (best is None or e["ts"] >= best["ts"]):
                best = e
        return best


def _is_comm_range(name: str) -> bool:
    return name.startswith(("nccl:", "gloo:"))


def analyse_timeline(events: List[dict], gap_us: float = 10.0) -> Dict:
    timed = _x(events, lambda e: True)
    t0 = min(e["ts"] for e in timed)
    t1 = max(e["ts"] + e.get("dur", 0.0) for e in timed)
    annotations = _x(events, lambda e: e.get("cat") == "user_annotation")
    phase_events = [e for e in annotations if e["name"] in PHASES]
    if not phase_events:
        raise ValueError("the trace has no forward/backward/optimizer ranges (was it written by --profile "
                         "--use-pytorch-profiler?)")
    tids = {}
    for e in phase_events:
        tids[e["tid"]] = tids.get(e["tid"], 0) + 1
    main_tid = max(tids, key=tids.get)
    host = _Ranges([e for e in annotations if e["tid"] == main_tid])
    kernels = _x(events, lambda e: e.get("cat") in GPU_WORK)
    on_gpu = bool(kernels)

    # Communication spans by kind, and compute spans with the host time each was issued at.
    comm: Dict[str, List[Span]] = {}
    compute: List[Tuple[Span, float]] = []
    if on_gpu:
        launches = {e["args"]["correlation"]: e["ts"] for e in _x(events, lambda e: e.get("cat") in (
            "cuda_runtime", "cuda_driver")) if "correlation" in e.get("args", {})}
        for k in kernels:
            issued = launches.get(k.get("args", {}).get("correlation"))
            if k["name"].lower().startswith("nccl"):
                pipeline = issued is not None and host.around(issued, lambda n: n.startswith("p2p:"))
                rng = host.around(issued, _is_comm_range) if issued is not None else None
                kind = PIPELINE_P2P if pipeline else comm_kind(rng["name"] if rng else k["name"])
                comm.setdefault(kind, []).append(_span(k))
            else:
                compute.append((_span(k), issued))
    else:
        for e in annotations:
            if _is_comm_range(e["name"]):
                rng = host.around(e["ts"], lambda n: n.startswith("p2p:")) if e["tid"] == main_tid else None
                comm.setdefault(PIPELINE_P2P if rng else comm_kind(e["name"]), []).append(_span(e))
        for e in _x(events, lambda e: e.get("cat") == "cpu_op" and e.get("tid") == main_tid
                    and not e["name"].startswith("c10d::")):
            compute.append((_span(e), e["ts"]))
    busy = union(s for s, _ in compute)
    comm_u = {k: union(v) for k, v in comm.items()}
    all_comm = union(s for v in comm.values() for s in v)
    wall = t1 - t0
    idle_spans = _gaps(union(busy + all_comm), t0, t1)

    # Phases: host time of the ranges, and the compute issued inside them.
    phases = {}
    for name in PHASES:
        ranges = union(_span(e) for e in phase_events if e["name"] == name and e["tid"] == main_tid)
        if on_gpu:
            inside = union(s for s, t in compute if t is not None and _inside(t, ranges))
        else:
            inside = intersect(busy, ranges)
        phases[name] = {"count": sum(1 for e in phase_events if e["name"] == name and e["tid"] == main_tid),
                        "host_ms": length(ranges) / 1e3, "compute_ms": length(inside) / 1e3}

    # Iterations and the pipeline bubble.
    schedule = _schedules(phase_events, main_tid, compute if on_gpu else None)
    sched_u = union(schedule)
    bubble_comm = intersect(all_comm, sched_u)
    p2p_exposed = minus(intersect(comm_u.get(PIPELINE_P2P, []), sched_u), busy)
    bubble = length(sched_u) - length(intersect(busy, sched_u))
    comm_in_bubble = minus(bubble_comm, busy)
    report = {
        "device": "gpu" if on_gpu else "cpu", "wall_ms": wall / 1e3, "iterations": len(schedule),
        "compute_ms": length(busy) / 1e3, "exposed_comm_ms": minus(all_comm, busy) / 1e3,
        "idle_ms": length(idle_spans) / 1e3,
        "phases": phases,
        "comm": {k: {"count": len(comm[k]), "ms": length(u) / 1e3, "exposed_ms": minus(u, busy) / 1e3}
                 for k, u in sorted(comm_u.items())},
        "pipeline": {"schedule_ms": length(sched_u) / 1e3, "bubble_ms": bubble / 1e3,
                     "bubble_p2p_ms": p2p_exposed / 1e3,
                     "bubble_other_comm_ms": (comm_in_bubble - p2p_exposed) / 1e3,
                     "bubble_idle_ms": (bubble - comm_in_bubble) / 1e3},
    }
    gaps = sorted(((b - a, a) for a, b in idle_spans if b - a > gap_us), reverse=True)
    report["host_gaps"] = {"count": len(gaps), "ms": sum(g for g, _ in gaps) / 1e3,
                           "longest_us": [round(g, 1) for g, _ in gaps[:5]]}
    return report


def _inside(t: float, ranges: List[Span]) -> bool:
    i = bisect_right([a for a, _ in ranges], t) - 1
    return i >= 0 and ranges[i][0] <= t <= ranges[i][1]


def _gaps(busy: List[Span], t0: float, t1: float) -> List[Span]:
    edges = [t0] + [x for s in busy for x in s] + [t1]
    return [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]


def _schedules(phase_events: List[dict], main_tid, compute) -> List[Span]:
    """One span per iteration: first forward start to last backward end (device time when ``compute`` holds
    the GPU work with its issue times), iterations split at each optimizer range."""
    spans, current = [], []
    for e in sorted((e for e in phase_events if e["tid"] == main_tid), key=lambda e: e["ts"]):
        if e["name"] == "optimizer":
            if current:
                spans.append(_span_of(current, compute))
            current = []
        else:
            current.append(e)
    if current and any(e["name"] == "backward" for e in current):
        spans.append(_span_of(current, compute))
    return spans


def _span_of(ranges: List[dict], compute) -> Span:
    first = ranges[0]
    last = max((e for e in ranges if e["name"] == "backward"), key=lambda e: e["ts"], default=ranges[-1])
    a, b = float(first["ts"]), float(last["ts"] + last.get("dur", 0.0))
    if compute:
        issued = [s for s, t in compute if t is not None and a <= t <= b]
        if issued:
            return (min(s[0] for s in issued), max(s[1] for s in issued))
    return (a, b)
