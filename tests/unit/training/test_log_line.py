"""--log-throughput: a second line with tokens/s and MFU after the (unchanged) Megatron log line."""
import re
import types

import pytest
import torch

from megatron.training import log_line


class _Timer:
    def elapsed(self, barrier=False):
        return 0.5  # one iteration per window (each call logs): 0.5 s per iteration


class _Timers:
    def __call__(self, name):
        return _Timer()

    def log(self, *a, **k):
        pass


@pytest.mark.parametrize("log_throughput", [True, False])
def test_training_log_prints_second_line(monkeypatch, capsys, log_throughput):
    args = types.SimpleNamespace(
        micro_batch_size=2, data_parallel_size=1, seq_length=64, log_interval=2, train_iters=10,
        consumed_train_samples=8, log_throughput=log_throughput, world_size=1, hidden_size=64, num_layers=2,
        num_attention_heads=4, kv_channels=None, ffn_hidden_size=256, vocab_size=128, padded_vocab_size=128,
        tensorboard_log_interval=1, log_timers_to_tensorboard=False, tensorboard_dir=None)
    monkeypatch.setattr(log_line, "get_args", lambda: args)
    monkeypatch.setattr(log_line, "get_timers", lambda: _Timers())
    monkeypatch.setattr(log_line, "get_tensorboard_writer", lambda: None)
    monkeypatch.setattr(log_line, "get_wandb_writer", lambda: None)
    monkeypatch.setattr(log_line, "_num_microbatches", lambda: 1)
    monkeypatch.setattr(log_line, "print_rank_last", print)
    total = {}
    log_line.training_log({"lm loss": torch.tensor(2.0)}, total, 1e-3, 1, 1.0, False, 0, 1.0, None, None)
    log_line.training_log({"lm loss": torch.tensor(2.0)}, total, 1e-3, 2, 1.0, False, 0, 1.0, None, None)
    lines = capsys.readouterr().out.splitlines()
    megatron_lines = [ln for ln in lines if " iteration " in ln]
    assert len(megatron_lines) == 2 and "throughput:" not in megatron_lines[-1]
    extra = [ln for ln in lines if ln.startswith(" throughput: tokens/s:")]
    if not log_throughput:
        assert extra == [] and "TFLOP/s/GPU" not in megatron_lines[-1]
        return
    assert len(lines) == 4 and lines[1] == extra[0] and lines[3] == extra[1]  # right after each log line
    # 2 x 64 tokens per iteration / 0.5 s
    assert re.fullmatch(r" throughput: tokens/s: 256 \| tokens/s/GPU: 256 \| MFU: .+ \|", extra[-1])


def test_max_attention_logit_in_line_and_tensorboard(monkeypatch, capsys):
    """--log-max-attention-logit: the field after params norm, and Megatron's `max_attention_logit` scalar."""
    args = types.SimpleNamespace(
        micro_batch_size=2, data_parallel_size=1, seq_length=64, log_interval=1, train_iters=10,
        consumed_train_samples=8, log_throughput=False, world_size=1, tensorboard_log_interval=1,
        log_timers_to_tensorboard=False, tensorboard_dir="tb", log_loss_scale_to_tensorboard=False,
        log_world_size_to_tensorboard=False, log_memory_to_tensorboard=False)
    scalars = {}
    writer = types.SimpleNamespace(add_scalar=lambda name, value, step: scalars.setdefault(name, value))
    monkeypatch.setattr(log_line, "get_args", lambda: args)
    monkeypatch.setattr(log_line, "get_timers", lambda: _Timers())
    monkeypatch.setattr(log_line, "get_tensorboard_writer", lambda: writer)
    monkeypatch.setattr(log_line, "get_wandb_writer", lambda: None)
    monkeypatch.setattr(log_line, "_num_microbatches", lambda: 1)
    monkeypatch.setattr(log_line, "print_rank_last", print)
    log_line.training_log({"lm loss": torch.tensor(2.0)}, {}, 1e-3, 1, 1.0, False, 0, 1.0, 3.5, None, 42.125)
    line = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln][0]
    assert " params norm: 3.500 | max attention logit: 42.125 | number of skipped" in line
    assert scalars["max_attention_logit"] == 42.125
    log_line.training_log({"lm loss": torch.tensor(2.0)}, {}, 1e-3, 2, 1.0, False, 0, 1.0, None, None)
    assert "max attention logit" not in capsys.readouterr().out


def test_log_memory_interval_repeats_the_memory_report(monkeypatch, capsys):
    """--log-memory-interval 4 (log interval 2): the device memory report at iterations 4 and 8, besides the first
    log line's; the report itself is CUDA's (faked here on CPU)."""
    args = types.SimpleNamespace(
        micro_batch_size=2, data_parallel_size=1, seq_length=64, log_interval=2, train_iters=10,
        consumed_train_samples=8, log_throughput=False, world_size=1, tensorboard_log_interval=1,
        log_timers_to_tensorboard=False, tensorboard_dir=None, log_memory_interval=4)
    for name, value in (("get_args", lambda: args), ("get_timers", lambda: _Timers()),
                        ("get_tensorboard_writer", lambda: None), ("get_wandb_writer", lambda: None),
                        ("_num_microbatches", lambda: 1), ("print_rank_last", print),
                        ("report_memory", lambda name, *_: f"{name} memory (MB) | allocated: 1.0"),
                        ("report_theoretical_memory", lambda a: None)):
        monkeypatch.setattr(log_line, name, value)
    monkeypatch.setattr(log_line.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(log_line.torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(log_line.parallel_state, "get_data_parallel_rank", lambda: 0)
    flag = True
    for it in range(1, 9):
        flag = log_line.training_log({"lm loss": torch.tensor(2.0)}, {}, 1e-3, it, 1.0, flag, 0, 1.0, None, None)
    reports = [ln for ln in capsys.readouterr().out.splitlines() if "memory (MB)" in ln]
    assert [int(r.split("(after ")[1].split()[0]) for r in reports] == [1, 4, 8]
