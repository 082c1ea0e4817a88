"""Pick the scan kernel for each mixer: Triton kernels on CUDA when their optional package is installed,
the eager chunked references otherwise (CPU, or no package), with one line saying so.

- Mamba-2 SSD: ``mamba-ssm``'s Triton ``mamba_chunk_scan_combined`` (``MAMBA_SKIP_CUDA_BUILD=TRUE pip install
  mamba-ssm``: its Triton kernels need no CUDA build, but the package's ``__init__`` imports the CUDA
  selective-scan extension, so the Triton subpackage is loaded on its own when that import fails).
- Gated delta rule: ``flash-linear-attention``'s (fla) ``chunk_gated_delta_rule`` (pure Triton); on Hopper with
  Triton 3.4.0 - 3.7.0, where fla's ``chunk_bwd_dqkwg`` kernel is wrong, fla 0.6.0's other kernels with that one
  backward step in PyTorch (``_fla_gated_delta.py``).
``MEGATRON_SSM_KERNELS=torch`` forces the eager references (benchmarks and tests compare the two).
"""
import importlib
import importlib.util
import logging
import os
import sys
import types

import torch

from megatron.core.ssm.ops.gated_delta_reference import chunk_gated_delta_rule_torch
from megatron.core.ssm.ops.ssd_reference import ssd_chunk_scan_torch

logger = logging.getLogger(__name__)
_cache = {}
_said = set()


def _say_once(what: str, message: str) -> None:
    if what not in _said:
        _said.add(what)
        logger.warning(message)


def keep_autotuning_on_disk() -> None:
    """Triton times every candidate config of an autotuned kernel again in each new process: for the SSD and gated
    delta rule kernels, tens of seconds at every start (a restarted job, each rank, each test process) before the
    first step. ``TRITON_CACHE_AUTOTUNING=1`` keeps each winner in Triton's disk cache (``TRITON_CACHE_DIR``) for
    the next process; Triton reads it when a kernel is defined, i.e. when its module is imported, so it is set
    before the first import of those modules, unless the environment already chose (``0`` keeps re-timing)."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def load_mamba_ssm_triton():
    """``mamba_ssm.ops.triton.ssd_combined`` or None. Without the CUDA extension the package's own
    ``__init__`` fails, so the package is registered bare (its path only) and the Triton module imported."""
    keep_autotuning_on_disk()
    try:
        return importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except ImportError as e:
        first_error = e
    spec = importlib.util.find_spec("mamba_ssm") if "mamba_ssm" not in sys.modules else None
    if spec is None or not spec.submodule_search_locations:
        _cache["mamba_ssm_error"] = str(first_error)
        return None
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["mamba_ssm"] = package
    try:
        return importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except ImportError as e:
        del sys.modules["mamba_ssm"]
        _cache["mamba_ssm_error"] = str(e)
        return None


def _triton_wanted(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("MEGATRON_SSM_KERNELS", "auto") != "torch"


def ssd_kernel(t: torch.Tensor):
    """The SSD scan for tensors like ``t``: mamba-ssm's Triton kernel on CUDA when installed, else eager."""
    if not _triton_wanted(t):
        return ssd_chunk_scan_torch
    if "ssd" not in _cache:
        module = load_mamba_ssm_triton()
        _cache["ssd"] = None if module is None else module.mamba_chunk_scan_combined
        if module is None:
            _say_once("ssd", "Mamba-2 SSD scan: mamba-ssm's Triton kernels are not importable "
                             f"({_cache.get('mamba_ssm_error')}); using the eager PyTorch scan "
                             "(MAMBA_SKIP_CUDA_BUILD=TRUE pip install mamba-ssm for the fast one)")
    return _cache["ssd"] or ssd_chunk_scan_torch


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def _fla_unsafe_here(device: torch.device) -> str:
    """Why fla's own gated delta rule must not run on this device, or "". fla's backward step ``chunk_bwd_dqkwg`` is
    wrong with Triton 3.4.0 up to 3.7.1 on Hopper (fla issue #640) unless tilelang provides it; fla raises in the
    backward then, mid-training. Checked up front so the mixer uses the PyTorch step from the first step."""
    if torch.cuda.get_device_capability(device)[0] != 9 or importlib.util.find_spec("tilelang") is not None:
        return ""
    try:
        triton_version = _version(importlib.import_module("triton").__version__)
    except ImportError:
        return ""
    if (3, 4, 0) <= triton_version < (3, 7, 1):
        return (f"Triton {'.'.join(map(str, triton_version))} on a Hopper GPU; Triton >= 3.7.1 or `pip install "
                "tilelang` makes it right")
    return ""


def _fla_with_torch_dqkwg(unsafe: str):
    """fla's kernels with the dq/dk/dw/dg backward step in PyTorch (where fla's own step is wrong), or None."""
    try:
        module = importlib.import_module("megatron.core.ssm.ops._fla_gated_delta")
        reason = module.unsupported_reason()
    except ImportError as e:
        reason = f"flash-linear-attention is not importable ({e})"
    if reason:
        _say_once("gdn", f"Gated DeltaNet: not using flash-linear-attention here ({unsafe}; {reason}); using the "
                         "eager PyTorch scan")
        return None
    _say_once("gdn", f"Gated DeltaNet: flash-linear-attention's kernels with the dq/dk/dw/dg backward step "
                     f"(chunk_bwd_dqkwg) in PyTorch: its Triton kernel is wrong here ({unsafe})")
    return module.chunk_gated_delta_rule_torch_dqkwg


def gated_delta_kernel(t: torch.Tensor):
    """The chunked gated delta rule for tensors like ``t``: fla's Triton kernel on CUDA when installed (one backward
    step in PyTorch on Hopper with Triton 3.4.0 - 3.7.0)."""
    if not _triton_wanted(t):
        return chunk_gated_delta_rule_torch
    if "gdn" not in _cache:
        keep_autotuning_on_disk()
        unsafe = _fla_unsafe_here(t.device)
        if unsafe:
            _cache["gdn"] = _fla_with_torch_dqkwg(unsafe)
            return _cache["gdn"] or chunk_gated_delta_rule_torch
        try:
            _cache["gdn"] = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
        except ImportError as e:
            _cache["gdn"] = None
            _say_once("gdn", f"Gated DeltaNet: flash-linear-attention is not importable ({e}); using the eager "
                             "PyTorch scan (pip install flash-linear-attention for the fast one)")
    return _cache["gdn"] or chunk_gated_delta_rule_torch


def ssd_scan(x, dt, A, B, C, chunk_size, D=None, initial_states=None, return_final_states=False):
    """y = SSD(x, dt, A, B, C) + D x with dt already softplus'ed and biased (see ssd_reference.py)."""
    kernel = ssd_kernel(x)
    return kernel(x, dt, A, B, C, chunk_size, D=D, initial_states=initial_states,
                  return_final_states=return_final_states)


def gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """(o, final state) of the chunked gated delta rule (see gated_delta_reference.py)."""
    kernel = gated_delta_kernel(q)
    return kernel(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state)
