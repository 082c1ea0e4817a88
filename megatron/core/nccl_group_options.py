"""Per-group NCCL communicator options: ``--nccl-communicator-config-path`` and ``--high-priority-stream-groups``.

Megatron's YAML maps a group name (``tp``, ``dp``, ``ep`` ...) to ``ProcessGroupNCCL.Options``: whether the
communicator's stream has high priority, and NCCL's ``cga_cluster_size`` / ``max_ctas`` / ``min_ctas`` /
``net_name``. A high-priority stream lets a communication kernel launched behind a running GEMM take SMs
as the GEMM's thread blocks retire, instead of waiting for the whole GEMM: what an overlapped collective
(``--tp-comm-overlap``'s ring, the DP grad reduce, the EP all-to-all) needs to run beside the compute.
"""
from typing import Dict, List, Optional

import torch

# Megatron's names for the groups in these configs -> ours (where they differ).
_FROM_MEGATRON = {"ep_tp": "etp", "tp_ep_mp": "tp_ep", "ep_dp": "edp"}
_TO_MEGATRON = {ours: theirs for theirs, ours in _FROM_MEGATRON.items()}
# Every group initialize_model_parallel builds, by Megatron's name.
GROUP_NAMES = ("dp", "dp_cp", "cp", "mp", "tp", "pp", "embd", "pos_embd", "tp_dp_cp", "tp_dp", "tp_cp", "ep",
               "ep_tp", "tp_ep_mp", "tp_ep_pp", "ep_dp")
_KEYS = ("is_high_priority_stream", "cga_cluster_size", "max_ctas", "min_ctas", "net_name")


def megatron_group_name(name: str) -> str:
    """Megatron's config name of our group ``name`` (``etp`` -> ``ep_tp``, others unchanged)."""
    return _TO_MEGATRON.get(name, name)


def nccl_group_configs(config_path: Optional[str], high_priority_groups: Optional[List[str]],
                       nccl: bool = True) -> Dict[str, dict]:
    """{group name: options} from the YAML at ``config_path`` plus ``is_high_priority_stream`` for each of
    ``high_priority_groups``; one ValueError line for an unknown group, key or file. With ``nccl`` False
    (a gloo run) the options have nothing to act on and a non-empty request is refused."""
    cfgs: Dict[str, dict] = {}
    if config_path:
        try:
            import yaml  # lazy: only runs that pass --nccl-communicator-config-path need PyYAML
        except ImportError as e:
            raise ValueError("--nccl-communicator-config-path needs PyYAML: pip install pyyaml") from e
        try:
            with open(config_path) as f:
                loaded = yaml.safe_load(f) or {}
        except OSError as e:
            raise ValueError(f"--nccl-communicator-config-path {config_path}: cannot read it ({e})") from e
        if not isinstance(loaded, dict) or not all(isinstance(v, dict) for v in loaded.values()):
            raise ValueError(f"--nccl-communicator-config-path {config_path}: expected a mapping of group name "
                             f"-> options, e.g. 'tp: {{is_high_priority_stream: true, max_ctas: 16}}'")
        for name, options in loaded.items():
            _check_name(name, f"--nccl-communicator-config-path {config_path}")
            bad = sorted(set(options) - set(_KEYS))
            if bad:
                raise ValueError(f"--nccl-communicator-config-path {config_path}: group '{name}' has unknown "
                                 f"option(s) {', '.join(bad)}; use {', '.join(_KEYS)}")
            net = options.get("net_name")
            if net is not None and str(net).lower() not in ("ib", "socket"):
                raise ValueError(f"--nccl-communicator-config-path {config_path}: group '{name}' net_name "
                                 f"'{net}' must be IB or socket")
            cfgs[name] = dict(options)
    for name in high_priority_groups or []:
        _check_name(name, "--high-priority-stream-groups")
        cfgs.setdefault(name, {})["is_high_priority_stream"] = True
    if cfgs and not nccl:
        raise ValueError("--nccl-communicator-config-path / --high-priority-stream-groups set NCCL communicator "
                         "options; this run's backend is gloo: drop them or run with NCCL")
    return cfgs


def _check_name(name, where):
    if name not in GROUP_NAMES:
        raise ValueError(f"{where}: unknown process group '{name}'; use one of {', '.join(GROUP_NAMES)}")


def get_nccl_options(pg_name, nccl_comm_cfgs):
    """ProcessGroupNCCL.Options for ``pg_name`` (Megatron's group name) from such a dict, else None."""
    cfg = (nccl_comm_cfgs or {}).get(pg_name)
    if cfg is None:
        return None
    options = torch.distributed.ProcessGroupNCCL.Options(
        is_high_priority_stream=cfg.get("is_high_priority_stream", False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in cfg:
            setattr(options.config, key, cfg[key])
    return options
