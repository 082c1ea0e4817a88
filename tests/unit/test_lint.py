"""The lint and import-order rules in ``ruff.toml`` hold for the whole checkout (``python -m ruff check .``).
ruff comes from requirements-test.txt; the product does not need it."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_passes():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    if "No module named ruff" in proc.stderr:
        raise AssertionError("ruff is missing: pip install -r requirements-test.txt")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
