"""--log-energy: the monitor's arithmetic (laps, pauses, total, J/iter/GPU and W/GPU) on a fake millijoule counter,
the log-line fields and TensorBoard scalars through training_log, and the start-up refusal without CUDA or NVML.
The product reads NVML's counter; only these tests replace it."""
import types

import pytest
import torch

from megatron.core import energy_monitor
from megatron.core.energy_monitor import EnergyMonitor, energy_log_fields
from megatron.training import global_vars, log_line
from megatron.training.diagnostics import energy
from tests.unit.training.arguments.test_arguments import assert_refused_in_one_line


class _Counter:
    """NVML's running total in millijoules, moved by hand."""

    def __init__(self, mj=1_000_000):
        self.mj = mj

    def __call__(self):
        return self.mj


def test_laps_leave_paused_spans_out():
    c = _Counter()
    m = EnergyMonitor(read_counter=c)
    m.resume()
    c.mj += 3_000  # 3 J of training
    m.pause()
    c.mj += 50_000  # evaluation: not counted
    m.resume()
    c.mj += 2_500
    assert m.lap() == pytest.approx(5.5)  # one rank (no process group): the sum is this rank's
    c.mj += 1_000
    assert m.lap() == pytest.approx(1.0)
    c.mj += 400
    m.shutdown()  # after the end nothing is read, and a later save's pause/resume is harmless
    m.pause()
    m.resume()
    assert m.lap() == 0.0
    assert m.get_total() == pytest.approx(6.5)


def test_failed_read_warns_once_and_counts_zero():
    c = _Counter()
    m = EnergyMonitor(read_counter=c)
    m.resume()
    c.mj += 2_000
    assert m.lap() == pytest.approx(2.0)

    def broken():
        raise RuntimeError("NVML_ERROR_UNKNOWN")
    m._read = broken
    with pytest.warns(UserWarning, match="--log-energy: reading the GPU energy counter failed"):
        assert m.lap() == 0.0
    assert m.get_total() == pytest.approx(2.0)


def test_a_failed_read_when_counting_resumes_does_not_count_from_zero():
    """The counter is a total since the driver loaded: a resume (after an evaluation) whose read fails must not
    start the span at 0 mJ, or the next lap reports the GPU's lifetime energy."""
    c = _Counter(mj=9_000_000_000)  # 9 MJ since the driver loaded
    m = EnergyMonitor(read_counter=c)
    m.resume()
    c.mj += 2_000
    m.pause()
    healthy = m._read
    m._read = lambda: (_ for _ in ()).throw(RuntimeError("NVML_ERROR_TIMEOUT"))
    with pytest.warns(UserWarning, match="reading the GPU energy counter failed"):
        m.resume()  # the span it opens has no start reading: it counts 0 J
    m._read = healthy
    c.mj += 1_000
    assert m.lap() == pytest.approx(2.0)
    c.mj += 500
    assert m.lap() == pytest.approx(0.5)  # counting goes on from the lap's reading
    assert m.get_total() == pytest.approx(2.5)


def test_per_gpu_fields_follow_megatron():
    # 8 GPUs used 4 000 J over 5 iterations of 0.25 s: 100 J per iteration per GPU, 400 W per GPU
    assert energy_log_fields(4000.0, 5, 8, 0.25) == pytest.approx((100.0, 400.0))


def _args(tensorboard_dir=None):
    return types.SimpleNamespace(
        micro_batch_size=2, data_parallel_size=1, seq_length=64, log_interval=2, train_iters=10,
        consumed_train_samples=8, log_throughput=True, world_size=1, hidden_size=64, num_layers=2,
        num_attention_heads=4, kv_channels=None, ffn_hidden_size=256, vocab_size=128, padded_vocab_size=128,
        tensorboard_log_interval=100, log_timers_to_tensorboard=False, tensorboard_dir=tensorboard_dir)


def test_log_line_fields_and_scalars(monkeypatch, capsys):
    """Two iterations of 0.5 s each using 300 J on the one GPU: 150 J/iter/GPU, 300 W/GPU, after the throughput
    and before the learning rate (Megatron's order); Megatron's TensorBoard names; the total at the end."""
    c = _Counter()
    monitor = EnergyMonitor(read_counter=c)
    monkeypatch.setattr(global_vars, "_GLOBAL_ENERGY_MONITOR", monitor)
    scalars = {}
    writer = types.SimpleNamespace(add_scalar=lambda name, value, step: scalars.setdefault(name, value))
    args = _args()
    timer = types.SimpleNamespace(elapsed=lambda barrier=False: 1.0)  # the window's 2 iterations
    monkeypatch.setattr(log_line, "get_args", lambda: args)
    monkeypatch.setattr(log_line, "get_timers", lambda: _Timers(timer))
    monkeypatch.setattr(log_line, "get_tensorboard_writer", lambda: writer)
    monkeypatch.setattr(log_line, "get_wandb_writer", lambda: None)
    monkeypatch.setattr(log_line, "_num_microbatches", lambda: 1)
    monkeypatch.setattr(log_line, "print_rank_last", print)
    energy.start()
    total = {}
    c.mj += 150_000
    log_line.training_log({"lm loss": torch.tensor(2.0)}, total, 1e-3, 3, 1.0, False, 0, 1.0, None, None)
    c.mj += 150_000
    with energy.paused():
        c.mj += 10_000_000  # a checkpoint save
    log_line.training_log({"lm loss": torch.tensor(2.0)}, total, 1e-3, 4, 1.0, False, 0, 1.0, None, None)
    line = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln][0]
    assert (" throughput per GPU (TFLOP/s/GPU): " in line
            and "| energy per GPU (J/iter/GPU): 150.0 | power per GPU (W/GPU): 300.0 | learning rate: " in line)
    assert scalars["iter-energy/gpu"] == pytest.approx(150.0) and scalars["power/gpu"] == pytest.approx(300.0)
    c.mj += 20_000  # after the last log point: in the total only
    monkeypatch.setattr(energy, "print_rank_0", print)
    energy.finish()
    assert "Total training energy (GPU): 0.000 MJ" in capsys.readouterr().out
    assert monitor.get_total() == pytest.approx(320.0)


class _Timers:
    def __init__(self, timer):
        self.timer = timer

    def __call__(self, name):
        return self.timer

    def log(self, *a, **k):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_refused_on_cpu():
    assert_refused_in_one_line("--log-energy", "--log-energy: it needs CUDA GPUs")


def test_refused_without_the_binding(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(energy_monitor, "pynvml", None)
    assert_refused_in_one_line("--log-energy", "--log-energy: the NVML binding is missing: pip install nvidia-ml-py")
