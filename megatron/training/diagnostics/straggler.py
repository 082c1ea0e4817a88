"""--log-straggler: at each log interval, the slowest and fastest ranks by their own step time.

A rank's own time is its wall time in train steps minus the time it spent blocked inside collectives
(from the hang recorder): in a synchronous step every rank waits for the slowest one, so wall times
alone are equal everywhere and hide the straggler. With --overlap-grad-reduce, or on GPU where NCCL
waits happen on the device, part of the wait is not seen and the spread shrinks accordingly.

`--straggler-ctrlr-port`: any HTTP request to rank 0 on that port toggles the report (`curl host:port`);
`--disable-straggler-on-startup` starts with it off. Rank 0's state reaches the others with the
per-interval all-gather of step times, so all ranks agree on when to report.
"""
import http.server
import socket
import threading
import time

import torch

from megatron.training.diagnostics import hang

_REPORTER = None


class StragglerReporter:
    def __init__(self, minmax_count, enabled=True, port=None):
        self.minmax_count, self.enabled = minmax_count, enabled
        self.own_s, self.steps, self._start, self._blocked_at_start = 0.0, 0, None, 0.0
        self.server = None
        if port is not None and torch.distributed.get_rank() == 0:
            self.server = _start_controller(self, port)

    def step_start(self):
        self._start, self._blocked_at_start = time.perf_counter(), hang.blocked_seconds()

    def step_end(self):
        if self._start is None:
            return
        blocked = hang.blocked_seconds() - self._blocked_at_start
        self.own_s += max(time.perf_counter() - self._start - blocked, 0.0)
        self.steps += 1
        self._start = None

    def report(self, iteration):
        """Collective on every rank; returns the line rank 0 printed (None elsewhere or when off)."""
        mean_ms = 1000.0 * self.own_s / max(self.steps, 1)
        mine = torch.tensor([mean_ms, float(self.enabled)], dtype=torch.float64)
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        gathered = [torch.zeros(2, dtype=torch.float64, device=device)
                    for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, mine.to(device))
        self.own_s, self.steps = 0.0, 0
        times = [float(t[0]) for t in gathered]
        self.enabled = bool(gathered[0][1])  # rank 0 owns the toggle
        if not self.enabled or torch.distributed.get_rank() != 0:
            return None
        line = format_report(iteration, times, self.minmax_count)
        print(line, flush=True)
        return line

    def close(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def format_report(iteration, times, count):
    order = sorted(range(len(times)), key=lambda r: times[r])
    count = min(count, len(times))
    slow = ", ".join(f"rank {r} {times[r]:.1f}" for r in reversed(order[-count:]))
    fast = ", ".join(f"rank {r} {times[r]:.1f}" for r in order[:count])
    ratio = times[order[-1]] / times[order[0]] if times[order[0]] > 0 else float("inf")
    return (f"straggler report at iteration {iteration} | own step time per rank (ms) | slowest: {slow} | "
            f"fastest: {fast} | slowest/fastest: {ratio:.2f}")


def _start_controller(reporter, port):
    class Toggle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            reporter.enabled = not reporter.enabled
            body = f"straggler report {'on' if reporter.enabled else 'off'}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    try:
        server = http.server.ThreadingHTTPServer(("", port), Toggle)
    except OSError as e:
        print(f"WARNING: --straggler-ctrlr-port {port}: {e}; the report cannot be toggled", flush=True)
        return None
    threading.Thread(target=server.serve_forever, name="straggler-ctrlr", daemon=True).start()
    print(f"> straggler report {'on' if reporter.enabled else 'off'}; toggle it with "
          f"curl http://{socket.gethostname()}:{server.server_address[1]}", flush=True)
    return server


def setup(args):
    """The reporter for --log-straggler (None without it)."""
    global _REPORTER
    if _REPORTER is not None:
        _REPORTER.close()
    _REPORTER = None
    if args.log_straggler:
        _REPORTER = StragglerReporter(args.straggler_minmax_count, not args.disable_straggler_on_startup,
                                      args.straggler_ctrlr_port)
    return _REPORTER


def get_reporter():
    return _REPORTER


def step_start():
    if _REPORTER is not None:
        _REPORTER.step_start()


def step_end(iteration, log_interval):
    """End of a train step; every rank reports at the log interval (a collective)."""
    if _REPORTER is None:
        return
    _REPORTER.step_end()
    if iteration % log_interval == 0:
        _REPORTER.report(iteration)
