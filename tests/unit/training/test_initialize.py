"""Launcher environment: SLURM variables and node-list parsing for MASTER_ADDR."""
import os

import pytest

from megatron.training.initialize import first_host, setup_launcher_env


@pytest.mark.parametrize("nodelist,host", [
    ("node[01-04,07]", "node01"), ("gpu5", "gpu5"), ("a[3,5],b[1-2]", "a3"), ("x-1,x-2", "x-1"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[11-12]")
    setup_launcher_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    assert os.environ["MASTER_ADDR"] == "node11" and os.environ["MASTER_PORT"] == "29500"


def test_single_process_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    setup_launcher_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1") and int(os.environ["MASTER_PORT"]) > 0


def test_single_process_binds_no_port(monkeypatch):
    """A one-rank run rendezvouses in process: a TCP store on MASTER_PORT would fail with EADDRINUSE while
    another process holds that port (here: this test's own listening socket)."""
    import socket
    import subprocess
    import sys

    from tests import ROOT
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code = ("import sys; from megatron.training.initialize import initialize_megatron; "
                "initialize_megatron(args_defaults={}, ignore_unknown_args=True); import torch.distributed as d; "
                "print('world', d.get_world_size())")
        argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                "--max-position-embeddings", "16", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "64", "--mock-data", "--train-iters", "1", "--lr", "1e-3"]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        p = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert p.returncode == 0 and "world 1" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]


def test_logging_level_prints_info_records(monkeypatch, capsys):
    """--logging-level 20: INFO records of any module reach stderr (Python's fallback handler alone drops them);
    a handler already installed is kept and not doubled."""
    import logging

    from megatron.training.initialize import set_logging_level
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    set_logging_level(logging.INFO)
    logging.getLogger("megatron.core.fusions.grouped_wgrad").info("chose the fused kernel")
    assert "INFO megatron.core.fusions.grouped_wgrad: chose the fused kernel" in capsys.readouterr().err
    set_logging_level(logging.INFO)
    assert len(root.handlers) == 1
