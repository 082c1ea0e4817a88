"""Launch a script under torchrun as users do, on a free port; once more on another port when the first was
taken by another process between choosing it and the launcher binding it (EADDRINUSE). torchrun's
--standalone avoids that race too but adds ~5 s of rendezvous to every launch.

A launch that runs past its ``timeout`` raises with the ranks' hang dumps attached (each rank's stacks and last
collectives, written by the hang watchdog after 90% of --distributed-timeout-minutes without progress), so a
stall on a loaded CI host says where it stood instead of only that it timed out."""
import glob
import os
import subprocess
import sys
import tempfile

from tests.parallel.dist_utils import free_port


def hang_dumps(port, limit=6000):
    """The text of the hang dumps a run on ``port`` left (the watchdog's default prefix names the master
    port), each cut to its last ``limit`` characters; '' when none was written."""
    parts = []
    for path in sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"megatron_hang_{port}_rank*.stacks.txt"))):
        with open(path, errors="replace") as f:
            parts.append(f"==== {path}\n{f.read()[-limit:]}")
    return "\n".join(parts)


def torchrun(nproc, argv, attempts=3, **run_kwargs):
    """subprocess.run of ``python -m torch.distributed.run --nproc-per-node nproc ... argv`` (text output
    captured); ``run_kwargs`` go to subprocess.run (cwd, env, timeout)."""
    for _ in range(attempts):
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(port)] + [str(a) for a in argv]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, **run_kwargs)
        except subprocess.TimeoutExpired as err:
            tail = (err.stderr or b"")[-3000:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            raise AssertionError(f"{' '.join(cmd)} ran past {err.timeout} s; stderr tail:\n{tail}\n"
                                 f"hang dumps:\n{hang_dumps(port) or '(none written)'}") from None
        if p.returncode == 0 or "EADDRINUSE" not in p.stderr + p.stdout:
            return p
    return p
