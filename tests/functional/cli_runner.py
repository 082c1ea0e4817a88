"""Run the real command-line entry points many times, cheaply: a server process imports torch and the
entry point's modules once, then forks one fresh process per rank for each run and executes the script
as `__main__` with the given argv and environment, exactly as `python script.py ...` would after its
imports. Ranks get the launcher environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*), and
each rank may get its own working directory or blocked modules (a node where a file or package differs).

    with CliRunner() as cli:
        runs = cli.run(["pretrain_gpt.py", ...], nranks=2, timeout=30)  # -> [RankResult(rc, out, err)]
"""
import json
import os
import subprocess
import sys
from collections import namedtuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RankResult = namedtuple("RankResult", "rc out err")

_SERVER = r'''
import gc, json, os, runpy, signal, socket, sys, tempfile, time, traceback
sys.path.insert(0, ROOT)
os.chdir(ROOT)
import torch  # noqa: F401  the expensive imports, shared by every forked run
import pretrain_gpt  # noqa: F401
import megatron.training.training  # noqa: F401
# Loaded lazily by every training run: torch._dynamo by the first torch.optim optimizer (~1.3 s of imports, sympy
# among them), the checkpoint code by the first save or load. Imported here once, not in each forked rank.
import torch._dynamo  # noqa: F401
import megatron.core.dist_checkpointing.serialization  # noqa: F401
# Everything imported so far into the permanent generation: a forked run's collections (pretrain's one before its
# loop) walk only what the run made, and do not write to, and so copy, every page of the server's heap.
gc.freeze()

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def child(req, rank, out_path, err_path):
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    code = 1
    try:
        os.environ.update(req["env"])
        os.environ.update(req["rank_env"][rank])
        os.chdir(req["cwd"][rank])
        for name in req["block"][rank]:
            sys.modules[name] = None  # `import name` raises ImportError, as on a machine without it
        sys.argv = req["argv"]
        runpy.run_path(req["argv"][0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

for line in sys.stdin:
    req = json.loads(line)
    n = req["nranks"]
    port = free_port()
    req["rank_env"] = [dict(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) if n > 1 else {} for r in range(n)]
    tmp = tempfile.mkdtemp(prefix="cli_runner_")
    paths = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(n)]
    for out, err in paths:
        open(out, "w").close()
        open(err, "w").close()
    sys.stdout.flush()
    pids = []
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            child(req, r, *paths[r])
        pids.append(pid)
    rcs, deadline = [None] * n, time.time() + req["timeout"]
    throttle, stopped, toggle_at = req["throttle"], False, time.time()
    pause, resume_at = req["pause"], None
    while None in rcs:
        if pause and resume_at is None and rcs[pause["rank"]] is None:
            with open(paths[pause["when_rank"]][0], errors="replace") as f:
                if pause["when_text"] in f.read():
                    os.kill(pids[pause["rank"]], signal.SIGSTOP)  # a frozen rank: it reaches no collective
                    resume_at = time.time() + pause["for_s"]
        if resume_at is not None and time.time() >= resume_at and rcs[pause["rank"]] is None:
            os.kill(pids[pause["rank"]], signal.SIGCONT)
            resume_at = float("inf")
        if throttle and rcs[throttle["rank"]] is None and time.time() >= toggle_at:
            stopped = not stopped  # a slow node: the rank runs run_ms, then stands still stop_ms
            os.kill(pids[throttle["rank"]], signal.SIGSTOP if stopped else signal.SIGCONT)
            toggle_at = time.time() + (throttle["stop_ms"] if stopped else throttle["run_ms"]) / 1000
        for r, pid in enumerate(pids):
            if rcs[r] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rcs[r] = os.waitstatus_to_exitcode(status)
        if req["stop_others"] and any(rc not in (None, 0) for rc in rcs):
            for r, pid in enumerate(pids):  # what torchrun does when a worker fails
                if rcs[r] is None:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGTERM)
        if None in rcs and time.time() > deadline:
            for r, pid in enumerate(pids):
                if rcs[r] is None:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    rcs[r] = "timeout"
        time.sleep(0.005)
    results = []
    for r in range(n):
        texts = []
        for p in paths[r]:
            with open(p, errors="replace") as f:
                texts.append(f.read())
            os.remove(p)
        results.append([rcs[r], texts[0], texts[1]])
    os.rmdir(tmp)
    print(json.dumps(results), flush=True)
'''


class CliRunner:
    """One server per test module; `run` is cheap (a fork), the server start pays the imports once.
    ``gpus=True`` leaves the GPUs visible (rank r uses cuda:r, NCCL)."""

    def __init__(self, gpus=False):
        self.gpus = gpus

    def __enter__(self):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        if not self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tests: gloo and CPU tensors even on a GPU machine
        self.proc = subprocess.Popen([sys.executable, "-c", f"ROOT = {ROOT!r}\n" + _SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        return self

    def run(self, argv, nranks=1, timeout=60, env=None, cwd=None, block=None, stop_others=False, throttle=None,
            pause=None):
        """Run ``argv`` (script first) on ``nranks`` ranks. ``cwd`` and ``block`` (module names that fail to
        import) are one value for all ranks or a list with one per rank. ``stop_others``: SIGTERM the other
        ranks once one fails, as torchrun does. ``throttle``: dict(rank, run_ms, stop_ms) alternately lets that rank
        run and stops it (SIGSTOP/SIGCONT), a slow node. ``pause``: dict(rank, when_rank, when_text, for_s) stops
        that rank for for_s seconds once when_rank has printed when_text (a frozen rank). Returns one
        RankResult per rank; rc is "timeout" for a rank killed at ``timeout`` seconds."""
        def per_rank(value, default):
            value = default if value is None else value
            return value if isinstance(value, list) and len(value) == nranks and isinstance(value[0], type(default)) \
                else [value] * nranks
        argv = [os.path.join(ROOT, str(argv[0]))] + [str(a) for a in argv[1:]]
        req = dict(argv=argv, nranks=nranks, timeout=timeout, env=env or {}, stop_others=stop_others,
                   throttle=throttle, pause=pause, cwd=[str(c) for c in per_rank(cwd, ROOT)], block=per_rank(block, []))
        for _ in range(3):
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the CLI runner server died")
            results = [RankResult(*r) for r in json.loads(line)]
            # The free port was taken by another process between choosing it and rank 0 binding it: the run
            # failed at the rendezvous, before it did anything; once more on another port, as a user would.
            if nranks == 1 or not any("EADDRINUSE" in r.out + r.err for r in results):
                return results
        return results

    def __exit__(self, *exc):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
