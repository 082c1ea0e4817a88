"""tools/trace_report.py on a hand-made trace whose answer is known: the named ranges add up, the GPU busy
time is the union of overlapping kernels on two streams, and the idle gaps over the threshold are counted
with the host operation each began under."""
import json

from tools.trace_report import analyse, main


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": 0}


EVENTS = [
    _x("forward", "user_annotation", 0, 100), _x("backward", "user_annotation", 100, 200),
    _x("optimizer", "user_annotation", 300, 50),
    _x("aten::mm", "cpu_op", 0, 40), _x("cudaStreamSynchronize", "cuda_runtime", 150, 60),
    _x("k1", "kernel", 10, 30), _x("k2", "kernel", 20, 30),  # overlapping streams: busy 10..50
    _x("k3", "kernel", 55, 5),  # a 5 us gap: under the threshold
    _x("copy", "gpu_memcpy", 200, 20),  # a 140 us gap that began at 60, under nothing but forward
    _x("k4", "kernel", 250, 100),  # a 30 us gap that began at 220, inside backward (the sync ended at 210)
]


def test_ranges_busy_idle_and_gaps():
    report = analyse(EVENTS, gap_us=10, top=5)
    assert report["wall_ms"] == 0.35
    assert report["ranges"]["forward"] == {"count": 1, "ms": 0.1}
    assert report["ranges"]["backward"]["ms"] == 0.2 and report["ranges"]["optimizer"]["count"] == 1
    gpu = report["gpu"]
    assert round(gpu["busy_ms"] * 1e3) == 40 + 5 + 20 + 100
    assert round(gpu["idle_ms"] * 1e3) == 5 + 140 + 30
    assert gpu["gaps"] == 2 and round(gpu["gaps_ms"] * 1e3) == 170
    assert gpu["longest"] == [{"us": 140.0, "host_op": "forward"}, {"us": 30.0, "host_op": "backward"}]
    assert gpu["by_host_op"] == [{"host_op": "forward", "gaps": 1, "ms": 0.14},
                                 {"host_op": "backward", "gaps": 1, "ms": 0.03}]


def test_cli_on_a_cpu_trace(tmp_path, capsys):
    path = tmp_path / "rank0.host.1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": [e for e in EVENTS if e["cat"] not in ("kernel", "gpu_memcpy")]}))
    assert main([str(path), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "ranges: forward 1x 0.1 ms, backward 1x 0.2 ms, optimizer 1x 0.1 ms" in out
    assert "no kernels in this trace" in out
    assert json.loads((tmp_path / "r.json").read_text())[str(path)]["ranges"]["forward"]["count"] == 1


def _k(name, ts, dur, corr, stream=7):
    return {"ph": "X", "name": name, "cat": "kernel", "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"correlation": corr}}


def _launch(ts, corr):
    return {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": ts, "dur": 2, "pid": 1, "tid": 1,
            "args": {"correlation": corr}}


# One GPU iteration (us): a forward GEMM, the pipeline send (NCCL kernel under p2p:forward-send), a backward
# GEMM overlapping half of a gradient all-reduce, the optimizer.
GPU_EVENTS = [
    {**_x("forward", "user_annotation", 0, 100), "pid": 1, "tid": 1}, _launch(10, 1), _k("gemm", 20, 60, 1),
    {**_x("p2p:forward-send", "user_annotation", 100, 20), "pid": 1, "tid": 1},
    {**_x("nccl:send", "user_annotation", 101, 18), "pid": 1, "tid": 1}, _launch(105, 2),
    _k("ncclDevKernel_SendRecv", 110, 40, 2, stream=9),
    {**_x("backward", "user_annotation", 120, 80), "pid": 1, "tid": 1}, _launch(130, 3), _k("gemm_bwd", 150, 100, 3),
    {**_x("nccl:all_reduce", "user_annotation", 135, 10), "pid": 1, "tid": 1}, _launch(140, 4),
    _k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200, 100, 4, stream=9),
    {**_x("optimizer", "user_annotation", 300, 50), "pid": 1, "tid": 1}, _launch(310, 5), _k("adam", 320, 20, 5),
]


def test_gpu_timeline_exposed_communication_and_bubble():
    t = analyse(GPU_EVENTS, gap_us=10)["timeline"]
    assert t["device"] == "gpu" and t["iterations"] == 1
    ms = lambda x: round(x * 1e3, 6)  # noqa: E731  (us, exact on these integers)
    assert (ms(t["compute_ms"]), ms(t["exposed_comm_ms"]), ms(t["idle_ms"])) == (180, 90, 80)  # sums to 350
    assert {k: (c["count"], ms(c["ms"]), ms(c["exposed_ms"])) for k, c in t["comm"].items()} == {
        "pp_p2p": (1, 40, 40), "all_reduce": (1, 100, 50)}
    # Compute is placed by the range that launched it, not by when the host ran.
    assert [ms(t["phases"][n]["compute_ms"]) for n in ("forward", "backward", "optimizer")] == [60, 100, 20]
    # Schedule on the device: the first forward kernel (20) to the last backward kernel's end (250).
    p = t["pipeline"]
    assert (ms(p["schedule_ms"]), ms(p["bubble_ms"]), ms(p["bubble_p2p_ms"]), ms(p["bubble_idle_ms"])) == \
        (230, 70, 40, 30)
    assert t["host_gaps"]["count"] == 3 and t["host_gaps"]["longest_us"] == [30.0, 20.0, 20.0]


def test_collective_spread_across_ranks_is_the_wait_for_slower_peers(tmp_path, capsys):
    """Two ranks of the same step: rank 1 spends 60 us more in an exposed all-to-all than rank 0 (it waited for
    rank 0's longer expert GEMM): the report lists min / mean / max and the mean excess over the least-waiting."""
    a2a = "ncclDevKernel_SendRecv"  # NCCL runs all-to-all as send/recv kernels: the launching range names it
    paths = []
    for rank, (gemm, wait) in enumerate(((100, 20), (40, 80))):
        events = [{**_x("forward", "user_annotation", 0, 200), "pid": 1, "tid": 1}, _launch(1, 1),
                  _k("expert_gemm", 10, gemm, 1),
                  {**_x("nccl:all_to_all", "user_annotation", 5, 5), "pid": 1, "tid": 1}, _launch(6, 2),
                  _k(a2a, 10 + gemm, wait, 2, stream=9)]
        path = tmp_path / f"rank{rank}.host.1.pt.trace.json"
        path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": rank}}))
        paths.append(str(path))
    assert main(paths + ["--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    from tools.trace_report import comm_spread
    reports = json.loads((tmp_path / "r.json").read_text())
    spread = comm_spread(reports)
    assert list(spread) == ["all_to_all"]
    c = spread["all_to_all"]
    assert (round(c["min_ms"] * 1e3), round(c["max_ms"] * 1e3), c["max_rank"]) == (20, 80, 1)
    assert round(c["wait_ms"] * 1e3) == 30  # mean 50 us, least 20 us
    assert "all_to_all exposed per rank: min 0.0, mean 0.1, max 0.1 ms (rank 1)" in out


def test_kernel_families_top_kernels_and_copies_alone():
    events = [
        _x("nvjet_tst_128x256_h_bz_coopA", "kernel", 0, 100),
        _x("nvjet_tst_128x256_h_bz_coopA", "kernel", 200, 100),
        _x("flash_fwd_kernel", "kernel", 300, 50),
        _x("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "kernel", 350, 20),
        _x("Memcpy PtoP (Device -> Device)", "gpu_memcpy", 50, 100),  # 50..100 under the GEMM, 100..150 alone
        _x("rmsnorm_fwd_kernel", "kernel", 400, 10),
        _x("vectorized_elementwise", "kernel", 410, 5),
    ]
    report = analyse(events, gap_us=10, top=3, kernels=2)
    k = report["kernels"]
    assert k["families_ms"] == {"gemm": 0.2, "copy": 0.1, "attention": 0.05, "nccl": 0.02, "custom": 0.01,
                                "other": 0.005}
    assert k["copy_alone_ms"] == 0.05
    assert k["top"] == [{"name": "nvjet_tst_128x256_h_bz_coopA", "count": 2, "ms": 0.2},
                        {"name": "Memcpy PtoP (Device -> Device)", "count": 1, "ms": 0.1}]
    assert "kernels" not in analyse(events, gap_us=10, top=3)  # only when asked
