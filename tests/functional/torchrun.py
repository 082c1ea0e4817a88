"""Launch a script under torchrun as users do, on a free port; once more on another port when the first was
taken by another process between choosing it and the launcher binding it (EADDRINUSE). torchrun's
--standalone avoids that race too but adds ~5 s of rendezvous to every launch."""
import subprocess
import sys

from tests.parallel.dist_utils import free_port


def torchrun(nproc, argv, attempts=3, **run_kwargs):
    """subprocess.run of ``python -m torch.distributed.run --nproc-per-node nproc ... argv`` (text output
    captured); ``run_kwargs`` go to subprocess.run (cwd, env, timeout)."""
    for _ in range(attempts):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port())] + [str(a) for a in argv]
        p = subprocess.run(cmd, capture_output=True, text=True, **run_kwargs)
        if p.returncode == 0 or "EADDRINUSE" not in p.stderr + p.stdout:
            return p
    return p
