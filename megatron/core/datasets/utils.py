"""Small shared pieces of the dataset pipeline: splits, blend parsing, logging, helper compilation."""
import logging
import os
import subprocess
import sys
import sysconfig
from enum import Enum
from typing import List, Optional, Tuple

import numpy
import torch

logger = logging.getLogger(__name__)

_DATASETS_DIR = os.path.dirname(os.path.abspath(__file__))


class Split(Enum):
    train = 0
    valid = 1
    test = 2


def log_single_rank(log: logging.Logger, level: int, msg: str, rank: int = 0) -> None:
    """Log only on `rank` (or always when torch.distributed is not initialised)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_rank() == rank:
        log.log(level, msg)


def normalize(weights: List[float]) -> List[float]:
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


def get_blend_from_list(blend: Optional[List[str]]) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Parse `--data-path`-style lists: `[w1, p1, w2, p2, ...]` or `[p1, p2, ...]`.

    Returns (prefixes, weights) with weights None when the list holds prefixes only.
    """
    if blend is None:
        return None
    if len(blend) % 2 == 1:
        return blend, None
    raw_weights = blend[0::2]
    try:
        weights = [float(w) for w in raw_weights]
    except ValueError:
        return blend, None
    prefixes = [p.strip() for p in blend[1::2]]
    return prefixes, weights


def _helpers_source_is_newer(so_path: str) -> bool:
    src = os.path.join(_DATASETS_DIR, "helpers.cpp")
    return not os.path.exists(so_path) or os.path.getmtime(so_path) < os.path.getmtime(src)


def _helpers_so_path() -> str:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return os.path.join(_DATASETS_DIR, "helpers_cpp" + suffix)


def _compile() -> None:
    so_path = _helpers_so_path()
    if not _helpers_source_is_newer(so_path):
        return
    try:
        import pybind11  # lazy: a build-time dependency, needed only when helpers.cpp must be compiled
    except ImportError as err:
        raise RuntimeError("building megatron/core/datasets/helpers.cpp needs pybind11: pip install pybind11") from err
    compiler = os.environ.get("CXX", "c++")
    include = sysconfig.get_paths()["include"]
    tmp = f"{so_path}.{os.getpid()}.tmp"
    cmd = [compiler, "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", f"-I{pybind11.get_include()}",
           f"-I{include}", os.path.join(_DATASETS_DIR, "helpers.cpp"), "-o", tmp]
    if sys.platform == "darwin":
        cmd[1:1] = ["-undefined", "dynamic_lookup"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError as err:
        raise RuntimeError(f"no C++ compiler '{compiler}' found to build the dataset helpers; install g++ "
                           "(or set CXX), or run `pip install -e .` on a machine that has one") from err
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"compiling megatron/core/datasets/helpers.cpp failed:\n{err.stderr}") from err
    os.replace(tmp, so_path)  # atomic: concurrent readers never see a half-written library


def compile_helpers() -> None:
    """Build the C++ helpers if missing or stale. Call on one rank; others wait at a barrier."""
    _compile()


def ensure_helpers_built() -> None:
    """Rank 0 compiles (if needed) while the other ranks wait; safe without torch.distributed."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        _compile()
    if distributed:
        torch.distributed.barrier()
