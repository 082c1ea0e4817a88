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
