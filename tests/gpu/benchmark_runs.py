"""tools/benchmark.py launched on two GPUs over NCCL, as the 2-GPU training comparisons run it: one run's
results line (losses, ms/iteration), printed so the GPU log shows each configuration's speed."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_two_gpus(tmp_path, name, model_flags: str, *flags, iters: int, warmup: int = 4, config: str = "gpt-125m"):
    results = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(ROOT, "tools", "benchmark.py"), "--config", config, "--iters", str(iters),
           "--warmup", str(warmup), "--results", str(results), "--", *model_flags.split(), *flags]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(results.read_text().splitlines()[-1])
    print(f"{name}: {result['ms_per_iter']:.1f} ms/iter, losses {result['losses'][:3]} ... {result['losses'][-1]}")
    return result
