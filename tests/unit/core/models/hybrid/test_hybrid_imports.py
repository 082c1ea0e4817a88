"""The hybrid package's import paths in a fresh interpreter, the MTP module first: importing it pulls in
HybridStack, so a package ``__init__`` that imported HybridModel eagerly would close a cycle that the static
import-graph test cannot see (it does not follow a package's ``__init__``)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[5])

CODE = """
import megatron.core.transformer.multi_token_prediction as mtp
from megatron.core.models.hybrid import HybridModel
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_model import HybridModel as DirectHybridModel
from megatron.core.models.mamba import MambaModel
assert mtp.HybridStack is HybridStack and HybridModel is DirectHybridModel and issubclass(MambaModel, HybridModel)
"""


def test_mtp_first_then_every_hybrid_import_path():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", CODE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
