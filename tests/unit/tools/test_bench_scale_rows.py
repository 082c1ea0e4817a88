"""Every row of tools/bench_scale_rows.sh (the scale issues' side-by-side rows) passes our argument validation
at its GPU count, with the profiling flags its PROFILE=1 mode adds: a row that a device call would only
refuse after minutes of start-up is caught here. Needs ../shared/megatron_reference (the flags' source)."""
import os
import subprocess

import pytest

from megatron.training.arguments import parse_args, validate_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
REFERENCE = os.path.join(os.path.dirname(ROOT), "shared", "megatron_reference")
SCRIPT = os.path.join(ROOT, "tools", "bench_scale_rows.sh")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(REFERENCE, "configs.sh")),
                                reason="../shared/megatron_reference is not beside this checkout")


def _script(*args):
    p = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, MREF_DIR=REFERENCE))
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_every_row_passes_argument_validation(monkeypatch):
    rows = [line.split()[0] for line in _script("--list").splitlines()]
    assert {"l8_tp2", "nemo_cp2", "nemo_cp2_a2a", "mix_ep2", "l8b_tp2dp2", "fine_ep4_overlap"} <= set(rows)
    for row in rows:
        gpus, *flags = _script("--flags", row).split()
        prof = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "8", "--profile-step-end", "9",
                "--profile-ranks", *map(str, range(int(gpus))), "--tensorboard-dir", "/tmp/tb"]
        for key, value in (("WORLD_SIZE", gpus), ("RANK", "0"), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(key, value)
        for extra in ([], prof):
            try:
                validate_args(parse_args(argv=flags + extra))
            except (Exception, SystemExit) as e:  # argparse exits on an unknown flag
                pytest.fail(f"row {row} ({gpus} GPUs){' + profiling' if extra else ''}: {type(e).__name__}: {e}")
