"""Where each pipeline stage's iteration goes: forward and backward compute, each kind of p2p transfer
(including the time spent waiting for the neighbour stage), the optimizer, and the rest (bubble, host).

    torchrun --nproc-per-node 2 tools/pipeline_timeline.py [--out DIR] [--skip 2] -- <pretrain_gpt.py flags>

Runs pretrain_gpt.py's training with the schedule's forward step, backward step, p2p calls and the
optimizer step bracketed by timestamps: CUDA events on the compute stream on GPUs (so a span covers what
the stream did, including waiting on a receive), the host clock on CPU. Iterations before --skip are left
out (compilation, allocator warm-up). Rank 0 prints one row per rank with the mean milliseconds per
iteration; --out gets a Chrome trace per rank (chrome://tracing or Perfetto) and summary.json.
The same analysis from the traces of ``--profile --use-pytorch-profiler``: ``tools/trace_report.py``.
"""
import argparse
import json
import os
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402


class Recorder:
    """Spans (name, category, start, end) per training iteration, placed on one time axis per rank."""

    def __init__(self, cuda: bool, skip: int):
        self.cuda, self.skip = cuda, skip
        self.iteration, self.offset = 0, 0.0
        self.pending, self.events, self.iterations = [], [], []
        self.start = None

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _ms(self, mark) -> float:
        return self.start.elapsed_time(mark) if self.cuda else (mark - self.start) * 1e3

    def span(self, name, category, fn, *args, **kwargs):
        if self.start is None:  # outside a training iteration (evaluation)
            return fn(*args, **kwargs)
        begin = self._mark()
        out = fn(*args, **kwargs)
        self.pending.append((name, category, begin, self._mark()))
        return out

    def begin_iteration(self):
        self.pending = []
        self.start = self._mark()

    def end_iteration(self):
        end = self._mark()
        if self.cuda:
            torch.cuda.synchronize()
        length = self._ms(end)
        if self.iteration >= self.skip:
            self.iterations.append(length)
            for name, category, begin, finish in self.pending:
                b = self._ms(begin)
                self.events.append({"name": name, "cat": category, "ts": self.offset + b,
                                    "dur": self._ms(finish) - b, "iteration": self.iteration + 1})
            self.offset += length
        self.iteration += 1
        self.start = None

    def summary(self) -> dict:
        n = max(len(self.iterations), 1)
        per, p2p = defaultdict(float), defaultdict(float)
        for e in self.events:
            (p2p if e["cat"] == "p2p" else per)[e["name"] if e["cat"] == "p2p" else e["cat"]] += e["dur"] / n
        total = sum(self.iterations) / n
        return {"iterations": len(self.iterations), "iteration_ms": total, "forward_ms": per["forward"],
                "backward_ms": per["backward"], "optimizer_ms": per["optimizer"],
                "p2p_ms": dict(sorted(p2p.items(), key=lambda kv: -kv[1])),
                "other_ms": total - sum(per.values()) - sum(p2p.values())}

    def chrome_trace(self, rank: int) -> dict:
        return {"traceEvents": [{"name": e["name"], "cat": e["cat"], "ph": "X", "ts": e["ts"] * 1e3,
                                 "dur": e["dur"] * 1e3, "pid": rank, "tid": e["cat"],
                                 "args": {"iteration": e["iteration"]}} for e in self.events]}


def install(rec: Recorder, on_last_iteration):
    """Wrap the schedule's forward and backward steps, the p2p calls, the optimizer step and the train step."""
    import megatron.core.pipeline_parallel.step as step
    import megatron.training.training as training
    from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, P2PHandle

    forward, backward = step.forward_microbatch, step.backward_step
    step.forward_microbatch = lambda *a, **k: rec.span("forward", "forward", forward, *a, **k)
    step.backward_step = lambda *a, **k: rec.span("backward", "backward", backward, *a, **k)
    timed = P2PCommunicator._timed
    P2PCommunicator._timed = lambda self, name, **k: rec.span(name, "p2p", timed, self, name, **k)
    # The overlapped interleaved schedule posts an exchange in _timed and waits for it later: that wait is
    # its exposed time (a handle already waited on returns at once and is not a span).
    wait = P2PHandle.wait
    P2PHandle.wait = lambda self: wait(self) if self.done else rec.span(f"{self.name}-wait", "p2p", wait, self)
    for cls in (MegatronOptimizer, ChainedOptimizer):
        step = cls.step
        cls.step = (lambda s: lambda self: rec.span("optimizer", "optimizer", s, self))(step)
    train_step = training.train_step

    def timed_train_step(*args, **kwargs):
        rec.begin_iteration()
        out = train_step(*args, **kwargs)
        rec.end_iteration()
        from megatron.training.global_vars import get_args
        args = get_args()
        if args.iteration + 1 == args.train_iters:  # the loop counts this iteration right after we return
            on_last_iteration()
        return out
    training.train_step = timed_train_step


def _print_table(rows):
    p2p_names = sorted({k for r in rows for k in r["p2p_ms"]})
    head = ["rank", "pp stage", "iteration", "forward", "backward"] + p2p_names + ["optimizer", "other"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [str(r["rank"]), str(r["pp_rank"]), f"{r['iteration_ms']:.1f}", f"{r['forward_ms']:.1f}",
                 f"{r['backward_ms']:.1f}"] + [f"{r['p2p_ms'].get(k, 0.0):.1f}" for k in p2p_names] \
            + [f"{r['optimizer_ms']:.1f}", f"{r['other_ms']:.1f}"]
        print("| " + " | ".join(cells) + " |")
    print("(ms per iteration, mean of %d iterations; p2p spans include waiting for the neighbour stage; "
          "'other' is the rest of the iteration: pipeline bubble not spent in a receive, host work, data)"
          % rows[0]["iterations"], flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="directory for timeline_rank<R>.json and summary.json")
    p.add_argument("--skip", type=int, default=2, help="leading iterations left out of the timeline")
    opts = p.parse_args(ours)

    import torch.distributed as dist

    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    rec = Recorder(torch.cuda.is_available(), opts.skip)

    def report():
        row = dict(rec.summary(), rank=dist.get_rank(), pp_rank=parallel_state.get_pipeline_model_parallel_rank())
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if opts.out:
            os.makedirs(opts.out, exist_ok=True)
            with open(os.path.join(opts.out, f"timeline_rank{dist.get_rank()}.json"), "w") as f:
                json.dump(rec.chrome_trace(dist.get_rank()), f)
        if dist.get_rank() == 0:
            if rows[0]["iterations"] == 0:
                print(f"pipeline_timeline: no iteration after --skip {opts.skip}; train longer", flush=True)
                return
            _print_table(rows)
            if opts.out:
                with open(os.path.join(opts.out, "summary.json"), "w") as f:
                    json.dump(rows, f, indent=1)

    install(rec, report)
    sys.argv = ["pretrain_gpt.py"] + flags
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


if __name__ == "__main__":
    main()
