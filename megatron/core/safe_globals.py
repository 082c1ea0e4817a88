"""Allow-list for ``torch.load(weights_only=True)`` of checkpoints that hold Megatron objects (the args
Namespace, OptimizerConfig, enums, numpy arrays, RNG generators).

Loaders here read their own checkpoints with weights_only=False from paths the user gives; these functions
serve code that loads with weights_only=True. Megatron calls register_safe_globals() when megatron.core is
imported and replaces torch.storage._load_from_bytes with safe_load_from_bytes; here megatron.core imports
lazily and leaves torch untouched, so call register_safe_globals() yourself before such a load.
"""
import io
from argparse import Namespace
from pathlib import PosixPath
from signal import Signals
from types import SimpleNamespace

import numpy
import torch

from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
from megatron.core.transformer.enums import AttnBackend, CudaGraphModule, CudaGraphScope, InferenceCudaGraphScope

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct


def _safe_globals():
    from megatron.core.optimizer import OptimizerConfig  # lazy: the optimizer package costs ~1.3 s of import
    return [SimpleNamespace, PosixPath, _reconstruct, numpy.ndarray, numpy.dtype, numpy.dtypes.UInt32DType,
            Namespace, AttnBackend, CudaGraphModule, CudaGraphScope, InferenceCudaGraphScope, ModelType,
            OptimizerConfig, RerunDiagnostic, RerunMode, RerunState, io.BytesIO, Signals, torch._C.Generator]


def register_safe_globals():
    """Add Megatron's checkpoint classes to torch's weights_only allow-list."""
    torch.serialization.add_safe_globals(_safe_globals())


def safe_load_from_bytes(b):
    """``torch.storage._load_from_bytes`` with weights_only=True."""
    return torch.load(io.BytesIO(b), weights_only=True)
