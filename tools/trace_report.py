"""Where a profiled window's time went, read from the Chrome traces that ``--profile --use-pytorch-profiler``
writes (one ``rank<R>.*.pt.trace.json`` per rank under ``--tensorboard-dir``).

    python tools/trace_report.py runs/tb/*.pt.trace.json [--gap-us 10] [--top 5] [--json out.json]

Per trace: the window's wall time; the step's named ranges (``forward``, ``backward``, ``optimizer``: count and
total ms, host side); and on the GPU, the time some kernel, copy or memset was running (the union over all
streams), the idle time between those, and the idle gaps longer than ``--gap-us`` (count, total, the longest
with the host operation that was running when each began: a launch-bound stretch shows up as many short gaps
under small host ops, a host wait as one long gap under a synchronising call). Then the pipeline timeline
of each rank (tools/trace_timeline.py: compute, each collective's and the pipeline p2p's time and exposed
time, the bubble inside the forward/backward schedule, host gaps; GPU traces and gloo CPU traces alike),
and with several traces one row per rank and pipeline stage.
"""
import argparse
import json
import os
import re
import sys
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.trace_timeline import analyse_timeline  # noqa: E402

RANGES = ("forward", "backward", "optimizer")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Kernel families by name, first match wins: what a per-family total compares between two layouts of one model
# (a TP=2 row's GEMMs against the one-GPU row's, say) when the whole step's compute grows.
FAMILIES = (
    ("nccl", re.compile(r"nccl", re.I)),
    ("copy", re.compile(r"^Memcpy|^Memset", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|_attn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|sm90_xmma|wgmma|cublas|matmul|_mm_", re.I)),
    ("custom", re.compile(r"^triton_|_kernel$", re.I)),  # Triton and hand-written kernels
)


def _spans(events, categories) -> List[Tuple[float, float, str]]:
    return sorted((e["ts"], e["ts"] + e.get("dur", 0.0), e.get("name", "")) for e in events
                  if e.get("ph") == "X" and e.get("cat") in categories)


def _union(spans) -> List[Tuple[float, float]]:
    merged: List[List[float]] = []
    for start, end, _ in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _host_op_at(host_ops, t: float) -> str:
    """The innermost host operation running at time ``t`` (the one that started last), or ''."""
    running = [(start, name) for start, end, name in host_ops if start <= t <= end]
    return max(running)[1] if running else ""


def _gaps_by_host_op(gaps, host_ops, top: int) -> List[Dict]:
    """The host operations under which the GPU sat idle longest in total (a synchronisation repeated per
    micro-batch shows up here as one op with many gaps, where the longest-gap list shows only single pauses)."""
    totals: Dict[str, List[float]] = {}
    for g, t in gaps:
        entry = totals.setdefault(_host_op_at(host_ops, t) or "-", [0, 0.0])
        entry[0] += 1
        entry[1] += g
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"host_op": op, "gaps": n, "ms": round(us / 1e3, 3)} for op, (n, us) in ranked]


def family(name: str) -> str:
    """The kernel family of a GPU event's name (``FAMILIES``), ``other`` when none matches."""
    for fam, pattern in FAMILIES:
        if pattern.search(name):
            return fam
    return "other"


def kernel_table(events: List[dict], top: int) -> Dict:
    """GPU time by kernel family and the ``top`` kernels by total time (count, ms), over kernels, copies and
    memsets. ``copy_alone_ms``: the time a copy ran while no kernel did, which ``busy`` counts but is a transfer
    the step waited on (copy-engine tensor-parallel transfers show up here, not as communication kernels)."""
    by_name: Dict[str, List[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES:
            entry = by_name.setdefault(e.get("name", ""), [0, 0.0])
            entry[0] += 1
            entry[1] += e.get("dur", 0.0)
    families: Dict[str, float] = {}
    for name, (_, us) in by_name.items():
        fam = family(name)
        families[fam] = families.get(fam, 0.0) + us / 1e3
    kernels = _union(_spans(events, ("kernel",)))
    copies = _union(_spans(events, ("gpu_memcpy",)))
    alone, k = 0.0, 0
    for start, end in copies:  # copy time not covered by any kernel: both lists sorted and disjoint inside
        covered = 0.0
        while k < len(kernels) and kernels[k][1] <= start:
            k += 1
        j = k
        while j < len(kernels) and kernels[j][0] < end:
            covered += min(end, kernels[j][1]) - max(start, kernels[j][0])
            j += 1
        alone += end - start - covered
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"families_ms": {f: round(ms, 3) for f, ms in sorted(families.items(), key=lambda kv: -kv[1])},
            "copy_alone_ms": round(alone / 1e3, 3),
            "top": [{"name": n, "count": c, "ms": round(us / 1e3, 3)} for n, (c, us) in ranked]}


def analyse(events: List[dict], gap_us: float = 10.0, top: int = 5, kernels: int = 0) -> Dict:
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e]
    if not timed:
        raise ValueError("the trace has no timed events")
    wall_us = max(e["ts"] + e.get("dur", 0.0) for e in timed) - min(e["ts"] for e in timed)
    ranges = {name: {"count": 0, "ms": 0.0} for name in RANGES}
    for e in timed:
        if e.get("cat") == "user_annotation" and e.get("name") in ranges:
            ranges[e["name"]]["count"] += 1
            ranges[e["name"]]["ms"] += e.get("dur", 0.0) / 1e3
    report = {"wall_ms": wall_us / 1e3, "ranges": ranges}
    busy = _union(_spans(timed, GPU_CATEGORIES))
    if busy:
        host_ops = _spans(timed, ("cpu_op", "cuda_runtime", "user_annotation"))
        gaps = [(b[0] - a[1], a[1]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] > gap_us]
        gaps.sort(reverse=True)
        report["gpu"] = {
            "busy_ms": sum(b - a for a, b in busy) / 1e3,
            "idle_ms": (busy[-1][1] - busy[0][0] - sum(b - a for a, b in busy)) / 1e3,
            "gaps": len(gaps), "gaps_ms": sum(g for g, _ in gaps) / 1e3,
            "longest": [{"us": round(g, 1), "host_op": _host_op_at(host_ops, t)} for g, t in gaps[:top]],
            "by_host_op": _gaps_by_host_op(gaps, host_ops, top),
        }
    if kernels and busy:
        report["kernels"] = kernel_table(timed, kernels)
    if any(e.get("cat") == "user_annotation" and e.get("name") in RANGES for e in timed):
        report["timeline"] = analyse_timeline(events, gap_us)
    return report


def analyse_trace(trace: Dict, gap_us: float = 10.0, top: int = 5, kernels: int = 0) -> Dict:
    """``analyse`` of a whole trace file's JSON, with the rank and its layout (pipeline stage) the trace names."""
    report = analyse(trace["traceEvents"], gap_us, top, kernels)
    layout = trace.get("megatron_parallel") or {}
    report["rank"] = (trace.get("distributedInfo") or {}).get("rank")
    report["layout"] = layout
    return report


def _print_timeline(t: Dict) -> None:
    print(f"  timeline ({t['device']}, {t['iterations']} iterations): compute {t['compute_ms']:.1f} ms, exposed "
          f"communication {t['exposed_comm_ms']:.1f} ms, idle {t['idle_ms']:.1f} ms")
    print("  phases: " + ", ".join(f"{n} {p['count']}x host {p['host_ms']:.1f} ms / compute {p['compute_ms']:.1f} ms"
                                   for n, p in t["phases"].items()))
    for kind, c in t["comm"].items():
        print(f"  comm {kind}: {c['count']}x {c['ms']:.1f} ms, exposed {c['exposed_ms']:.1f} ms")
    p = t["pipeline"]
    print(f"  schedule {p['schedule_ms']:.1f} ms, bubble {p['bubble_ms']:.1f} ms (pipeline p2p "
          f"{p['bubble_p2p_ms']:.1f}, other communication {p['bubble_other_comm_ms']:.1f}, "
          f"idle {p['bubble_idle_ms']:.1f})")
    g = t["host_gaps"]
    print(f"  gaps with nothing running: {g['count']} over the threshold, {g['ms']:.1f} ms; longest (us): "
          f"{', '.join(str(x) for x in g['longest_us']) or '-'}")


def _print_ranks(reports: Dict[str, Dict]) -> None:
    """One row per trace, by rank: the pipeline stage and where its window went (ms)."""
    rows = sorted((r for r in reports.values() if "timeline" in r),
                  key=lambda r: (r.get("rank") is None, r.get("rank") or 0))
    head = ["rank", "pp stage", "window", "forward", "backward", "optimizer", "compute", "exposed p2p",
            "exposed collectives", "bubble", "idle"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        t, lay = r["timeline"], r["layout"]
        p2p = t["comm"].get("pp_p2p", {}).get("exposed_ms", 0.0)
        stage = f"{lay['pp_rank']}/{lay['pp_size']}" if "pp_rank" in lay else "?"
        cells = [str(r.get("rank")), stage, f"{r['wall_ms']:.1f}"] + \
            [f"{t['phases'][n]['compute_ms']:.1f}" for n in RANGES] + \
            [f"{t['compute_ms']:.1f}", f"{p2p:.1f}", f"{t['exposed_comm_ms'] - p2p:.1f}",
             f"{t['pipeline']['bubble_ms']:.1f}", f"{t['idle_ms']:.1f}"]
        print("| " + " | ".join(cells) + " |")
    print("(ms in the profiled window; forward/backward/optimizer: compute issued inside each range; exposed: "
          "communication with no compute running; bubble: the part of the forward/backward schedule without compute)")
    spread = comm_spread(reports)
    for kind, c in spread.items():
        print(f"  {kind} exposed per rank: min {c['min_ms']:.1f}, mean {c['mean_ms']:.1f}, max {c['max_ms']:.1f} "
              f"ms (rank {c['max_rank']}); above the least-waiting rank: {c['wait_ms']:.1f} ms on average")
    if spread:
        print("(a collective ends on every rank when the last one joins: the exposed time a rank has above the "
              "least-waiting rank is time spent waiting for slower peers, e.g. the busiest expert-parallel rank "
              "in the all-to-all, or the stage before in the pipeline)")


def comm_spread(reports: Dict[str, Dict]) -> Dict[str, Dict]:
    """Per collective kind seen on every rank: exposed ms min / mean / max over the ranks, the rank with the most,
    and the mean excess over the minimum (``wait_ms``). The least-waiting rank's exposed time is the transfer
    itself plus what all ranks share; the excess of the others is waiting for a slower peer, which a balanced
    load (routing, pipeline stages) would not pay."""
    timelines = {r.get("rank"): r["timeline"] for r in reports.values() if "timeline" in r}
    if len(timelines) < 2:
        return {}
    kinds = set.intersection(*(set(t["comm"]) for t in timelines.values()))
    out = {}
    for kind in sorted(kinds):
        exposed = {rank: t["comm"][kind]["exposed_ms"] for rank, t in timelines.items()}
        low, mean = min(exposed.values()), sum(exposed.values()) / len(exposed)
        out[kind] = {"min_ms": low, "mean_ms": mean, "max_ms": max(exposed.values()),
                     "max_rank": max(exposed, key=exposed.get), "wait_ms": mean - low}
    return out


def _print(path: str, report: Dict) -> None:
    print(f"{os.path.basename(path)}: window {report['wall_ms']:.1f} ms")
    print("  ranges: " + ", ".join(f"{n} {r['count']}x {r['ms']:.1f} ms" for n, r in report["ranges"].items()))
    gpu = report.get("gpu")
    if gpu is None:
        print("  gpu: no kernels in this trace (a CPU run)")
        return
    print(f"  gpu: busy {gpu['busy_ms']:.1f} ms, idle {gpu['idle_ms']:.1f} ms, {gpu['gaps']} gaps "
          f"over the threshold totalling {gpu['gaps_ms']:.1f} ms")
    for gap in gpu["longest"]:
        print(f"    {gap['us']:9.1f} us idle, host in: {gap['host_op'] or '-'}")
    print("  idle by the host op it started under: " + "; ".join(
        f"{o['host_op']} {o['ms']:.1f} ms in {o['gaps']}" for o in gpu["by_host_op"]))


def _print_all(path: str, report: Dict) -> None:
    _print(path, report)
    k = report.get("kernels")
    if k:
        print("  gpu time by family (ms): " + ", ".join(f"{f} {ms:.1f}" for f, ms in k["families_ms"].items())
              + f"; copies with no kernel running {k['copy_alone_ms']:.1f}")
        for row in k["top"]:
            print(f"    {row['ms']:9.2f} ms {row['count']:6d}x  {row['name'][:110]}")
    if "timeline" in report:
        _print_timeline(report["timeline"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="rank<R>.*.pt.trace.json files")
    parser.add_argument("--gap-us", type=float, default=10.0, help="GPU idle gaps shorter than this are ignored")
    parser.add_argument("--top", type=int, default=5, help="how many of the longest gaps to list")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also list GPU time by kernel family and the N kernels with the most time")
    parser.add_argument("--json", help="also write the reports here")
    args = parser.parse_args(argv)
    reports = {}
    for path in args.traces:
        with open(path) as f:
            reports[path] = analyse_trace(json.load(f), args.gap_us, args.top, args.kernels)
        _print_all(path, reports[path])
    if len(reports) > 1:
        _print_ranks(reports)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
