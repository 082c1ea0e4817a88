"""tools/benchmark.py launched on two GPUs over NCCL, as the 2-GPU training comparisons run it: one run's
results line (losses, ms/iteration), printed so the GPU log shows each configuration's speed, and a stalled run's
stacks and last collectives in its failure (`hang_flags`, `hang_dumps`); and the GPU tests' timing helpers
(`gpu_ms`: wall time between CUDA events; `kernel_profile`: the kernels' own GPU time and count)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_two_gpus(tmp_path, name, model_flags: str, *flags, iters: int, warmup: int = 4, config: str = "gpt-125m",
                 nproc: int = 2):
    results = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           os.path.join(ROOT, "tools", "benchmark.py"), "--config", config, "--iters", str(iters),
           "--warmup", str(warmup), "--results", str(results), "--", *model_flags.split(), *flags]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    dumps = tmp_path / f"{name}_hang"
    p = launch(cmd + hang_flags(dumps), timeout=2 * HANG_S, env=env, what=lambda: hang_dumps(dumps))
    assert p.returncode == 0, failure_text(p) + hang_dumps(dumps)
    result = json.loads(results.read_text().splitlines()[-1])
    print(f"{name}: {result['ms_per_iter']:.1f} ms/iter, losses {result['losses'][:3]} ... {result['losses'][-1]}")
    return result


# A run that makes no progress for HANG_S seconds dumps every rank's stacks and NCCL's last collectives (the hang
# watchdog and the flight recorder) and its collectives abort; the launch's own limit lies beyond both, so a stall
# fails with where each rank stood instead of a suite file cut off with nothing to show (a lane's limit is 370 s).
HANG_S = 150


def hang_flags(folder) -> list:
    """The training flags that make a stalled run dump its ranks' state under ``folder``."""
    return ["--distributed-timeout-seconds-after-init", str(HANG_S),
            "--flight-recorder-dump-path", str(folder / "rank")]


def hang_dumps(folder, limit: int = 4000) -> str:
    """The ranks' hang dumps under ``folder`` (their stacks and last collectives), each cut to ``limit``."""
    if not folder.is_dir():
        return ""
    return "".join(f"\n== {f.name}\n{f.read_text(errors='replace')[:limit]}" for f in sorted(folder.iterdir()))


def launch(cmd, timeout: float, env=None, cwd=ROOT, what=None, tail: int = 3000) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a launch with its output captured; one that outlives ``timeout`` fails with what it
    printed until then (a bare TimeoutExpired shows nothing of where the run stood) and ``what`` (e.g. the
    ranks' hang dumps: a string, or a function called on the timeout)."""
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        extra = (what() if callable(what) else what) or ""
        raise AssertionError(f"no exit after {timeout:g} s: {' '.join(map(str, cmd[:8]))} ...\n"
                             f"{out[-tail:]}\n{err[-tail:]}\n{extra}") from None


def failure_text(p, tail: int = 3000) -> str:
    """A failed launch's output for the assertion: the tails of stdout and stderr and, when stderr's tail does not
    reach it, the first traceback in stderr (a rank's first error; a CUDA-graph capture that fails reports the
    cause first and only a generic capture error at the end)."""
    first = p.stderr.find("Traceback")
    head = p.stderr[first:first + tail] + "\n...\n" if 0 <= first < len(p.stderr) - tail else ""
    return p.stdout[-tail:] + head + p.stderr[-tail:]


def gpu_ms(fn, reps: int = 20) -> float:
    """Milliseconds per call of ``fn()`` on the GPU (CUDA events), after three warm-up calls."""
    import torch  # lazy: this module also serves launches that never touch CUDA
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernel_profile(fn, reps: int = 5) -> tuple:
    """(GPU ms, kernels) per call of ``fn()``: the summed device time of the CUDA kernels and copies it launches
    (torch.profiler), after three warm-up calls. Unlike `gpu_ms` this leaves out the host's time to issue them,
    which dominates small launches in a Python loop and is not what a kernel comparison is about."""
    import torch  # lazy: this module also serves launches that never touch CUDA
    from torch.profiler import ProfilerActivity, profile  # lazy: as above
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in device) / reps / 1000, len(device) / reps
