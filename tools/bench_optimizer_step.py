"""Optimizer step time of Muon against AdamW on the same model, read from the training log's timers.

    python tools/bench_optimizer_step.py --config llama3-8b [--nproc 1] [--iters 12] [-- <Megatron flags>]

Runs pretrain_gpt.py once per optimizer (`--optimizer adam`, then `--optimizer muon`, each with the
same model, data and `--timing-log-level 1`), takes the `optimizer` timer (the whole optimizer.step(),
max over ranks, ms per iteration) of every log interval after the first (compile and allocator warm-up)
and prints the medians and their ratio. Extra flags after `--` go to both runs (e.g. `--optimizer`
variants such as `--muon-tp-mode duplicated`, or `--use-distributed-optimizer`, which makes Muon
dist_muon). Exit status 1 when the ratio exceeds --max-ratio.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.benchmark import _COMMON, CONFIGS  # noqa: E402 (after sys.path)

TIMER = re.compile(r"^ +optimizer \.+: \(?([\d.]+)(?:, ([\d.]+)\))?$", re.M)


def step_times(config, optimizer, nproc, iters, interval, extra):
    argv = (f"{CONFIGS[config]} {_COMMON} --train-iters {iters} --timing-log-level 1 --log-interval {interval} "
            f"--optimizer {optimizer}").split() + extra
    # _COMMON sets a huge --log-interval; the later value wins in argparse. --standalone takes a free port,
    # so two benchmarks on one machine (disjoint GPUs) do not collide on torchrun's default 29500.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "pretrain_gpt.py")] + argv
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if p.returncode != 0:
        raise SystemExit(f"{optimizer} run failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    # One value per log interval: (min, max) across ranks, already per iteration (normalised by the interval).
    values = [float(m.group(2) or m.group(1)) for m in TIMER.finditer(p.stdout)]
    if len(values) < 2:
        raise SystemExit(f"{optimizer}: no `optimizer` timer in the log (needs --timing-log-level 1)")
    return values[1:]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="llama3-8b")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--log-interval", type=int, default=3)
    p.add_argument("--max-ratio", type=float, default=1.5, help="fail above this Muon / AdamW ratio")
    cli = p.parse_args(argv)
    adam = statistics.median(step_times(cli.config, "adam", cli.nproc, cli.iters, cli.log_interval, extra))
    muon = statistics.median(step_times(cli.config, "muon", cli.nproc, cli.iters, cli.log_interval, extra))
    ratio = muon / adam
    print(f"optimizer step ({cli.config}, {cli.nproc} process(es), {' '.join(extra) or 'no extra flags'}): "
          f"adam {adam:.2f} ms, muon {muon:.2f} ms, muon / adam {ratio:.2f} (limit {cli.max_ratio})")
    return 0 if ratio <= cli.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
