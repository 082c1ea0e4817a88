"""What starting a run imports: the entry script and the model code must not pull in
torch.distributed.checkpoint (with DTensor, ~0.6 s of every launch on a 2-core machine, a third of the import
time beyond torch); the checkpoint entry points resolve on first use. A fresh interpreter, since this
process has imported everything already."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import sys
import pretrain_gpt
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import gpt_layer_specs
gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True)
eager = sorted(m for m in sys.modules if m.startswith(("torch.distributed.checkpoint", "torch.distributed.tensor")))
print("EAGER", eager)
assert callable(dist_checkpointing.save) and dist_checkpointing.serialization.load is dist_checkpointing.load
print("RESOLVED", "torch.distributed.checkpoint" in sys.modules)
"""


def test_entry_script_and_model_code_do_not_import_dcp():
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "EAGER []" in p.stdout, p.stdout
    assert "RESOLVED True" in p.stdout  # the lazy names still reach the real functions


def test_unknown_name_is_an_attribute_error():
    from megatron.core import dist_checkpointing
    assert not hasattr(dist_checkpointing, "no_such_name")
    assert dist_checkpointing.AsyncCallsQueue.__name__ == "AsyncCallsQueue"
