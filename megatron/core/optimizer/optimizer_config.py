"""Configuration of the optimizer (Megatron Core's `OptimizerConfig`)."""
import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple, Union

import torch

from megatron.core._compat_fields import check_compat_fields
from megatron.core.optimizer._compat_fields import OptimizerConfigCompat
from megatron.core.optimizer.muon import NS_COEFFICIENTS, SCALE_MODES, TP_MODES

# Megatron's names of the optimizer dtypes (fp8 is torch.uint8 there).
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "fp8"}
_PRECISION_AWARE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def as_optimizer_dtype(value):
    """A torch dtype, or Megatron's name of one ('fp32', 'bf16', 'fp16', 'fp8'), as a torch dtype."""
    if isinstance(value, str):
        names = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
        if value not in names:
            raise ValueError(f"optimizer dtype {value!r}: use one of {', '.join(names)}")
        return names[value]
    return value


@dataclass
class OptimizerConfig(OptimizerConfigCompat):
    optimizer: str = "adam"
    """'adam' (AdamW: decoupled weight decay), 'sgd', 'muon' (Muon on the 2-D hidden weights, AdamW on the
    rest) or 'dist_muon' (Megatron's older name of muon with use_layer_wise_distributed_optimizer)."""

    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    """Separate LR for the embedding and output-layer params (None: same as the others)."""
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False
    """get_standard_config_overrides: q/k layernorm weights keep weight decay (other 1-D params do not)."""

    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32

    loss_scale: Optional[float] = None
    """Static loss scale; None with fp16 means dynamic scaling."""
    initial_loss_scale: float = 2 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    sgd_momentum: float = 0.9

    # Muon (optimizer 'muon'); see megatron/core/optimizer/muon.py. Defaults are Megatron Core's.
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    """Orthogonalise the fused QKV weight as three matrices (all q rows, all k rows, all v rows)."""
    muon_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    """Newton-Schulz precision: 'medium' runs it in bf16, 'high' in fp32 (TF32 on CUDA)."""
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    """'blockwise' (each TP shard on its own), 'duplicated' (whole matrix gathered over TP) or 'distributed'
    (whole-matrix result from the shards, Gram matrices all-reduced over TP)."""
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"
    """Optimizer of the params Muon does not take (embeddings, output layer, norms, biases): 'adam' or 'lion'."""
    lion_beta1: float = 0.95
    """Lion: weight of the momentum in the update's sign (the rest is the gradient's)."""
    lion_beta2: float = 0.98
    """Lion: decay of the momentum."""
    use_layer_wise_distributed_optimizer: bool = False
    """Muon sharded over data-parallel ranks by whole weight matrices, AdamW params by the distributed
    optimizer (needs DDP with use_distributed_optimizer and params tagged by tag_params_for_buffer_routing)."""

    use_precision_aware_optimizer: bool = False
    """Let the dtypes below be 16-bit (Adam with the distributed optimizer only; see precision_aware_adam.py)."""
    main_grads_dtype: torch.dtype = torch.float32
    """Gradients the optimizer reads: fp32, or bf16 (the DDP grad buffer itself, reduced in bf16)."""
    main_params_dtype: torch.dtype = torch.float32
    """Master copies of 16-bit params: fp32 or fp16."""
    exp_avg_dtype: torch.dtype = torch.float32
    """Adam's first moment: fp32 or bf16."""
    exp_avg_sq_dtype: torch.dtype = torch.float32
    """Adam's second moment: fp32 or bf16."""

    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False

    clip_grad: float = 1.0
    """Global L2 norm clip (0 disables clipping; the norm is still computed and returned)."""
    log_num_zeros_in_grad: bool = False

    barrier_with_L1_time: bool = False
    timers: Optional[Callable] = None

    def __post_init__(self):
        check_compat_fields(self, OptimizerConfigCompat)
        if self.optimizer not in ("adam", "sgd", "lion", "muon", "dist_muon"):
            raise ValueError(f"--optimizer {self.optimizer} is not supported; use adam, sgd, lion, muon or dist_muon")
        if self.optimizer in ("muon", "dist_muon"):
            self._check_muon()
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive; pick one")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather requires --use-distributed-optimizer")
        if self.overlap_param_gather_with_optimizer_step:
            raise NotImplementedError(
                "--overlap-param-gather-with-optimizer-step is not supported; use --overlap-param-gather")
        if self.clip_grad < 0:
            raise ValueError("--clip-grad must be >= 0 (0 disables clipping)")
        for name in _PRECISION_AWARE_FIELDS:
            setattr(self, name, as_optimizer_dtype(getattr(self, name)))
        check_precision_aware(self)

    def _check_muon(self):
        checks = [
            (not self.fp16, "--optimizer muon does not support --fp16 (as in Megatron); use --bf16"),
            (self.muon_scalar_optimizer in ("adam", "lion"), f"--muon-scalar-optimizer {self.muon_scalar_optimizer}"
                                                               " is not supported; use adam or lion"),
            (self.muon_scale_mode in SCALE_MODES, f"--muon-scale-mode {self.muon_scale_mode}: use one of "
                                                  f"{', '.join(SCALE_MODES)}"),
            (self.muon_tp_mode in TP_MODES, f"--muon-tp-mode {self.muon_tp_mode}: use one of {', '.join(TP_MODES)}"),
            (self.muon_coefficient_type in NS_COEFFICIENTS, f"--muon-coefficient-type {self.muon_coefficient_type}:"
                                                            f" use one of {', '.join(NS_COEFFICIENTS)}"),
            (self.muon_num_ns_steps >= 1, f"--muon-num-ns-steps must be >= 1, got {self.muon_num_ns_steps}"),
            (self.muon_fp32_matmul_prec in ("medium", "high"),
             f"--muon-fp32-matmul-prec {self.muon_fp32_matmul_prec}: use medium (bf16 Newton-Schulz) or high (fp32)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)



@dataclass
class AdamOptimizerConfig(OptimizerConfig):
    """OptimizerConfig for Adam (AdamW): the adam_* fields apply."""
    optimizer: str = "adam"


@dataclass
class SGDOptimizerConfig(OptimizerConfig):
    """OptimizerConfig for SGD with momentum (sgd_momentum)."""
    optimizer: str = "sgd"

# Megatron 0.19's parameter-selection types (keys of its per-parameter config overrides). They select
# parameters for real; get_megatron_optimizer does not take override dicts (see docs/api.md).
@dataclass(frozen=True)
class ParamPredicate:
    """A named test on a parameter; the name keeps keys hashable and readable."""
    name: str
    fn: Callable[[torch.nn.Parameter], bool]

    def __call__(self, param: torch.nn.Parameter) -> bool:
        return self.fn(param)


@dataclass(frozen=True)
class ParamWithNamePredicate:
    """A named test on a parameter and its qualified name."""
    name: str
    fn: Callable[[torch.nn.Parameter, str], bool]

    def __call__(self, param: torch.nn.Parameter, param_name: str) -> bool:
        return self.fn(param, param_name)


@dataclass(frozen=True)
class ParamKey:
    """Selects a parameter when any criterion holds: a glob on its name, a true attribute, a predicate."""
    name: Union[str, Tuple[str, ...]] = field(default_factory=tuple)
    attr: Union[str, Tuple[str, ...]] = field(default_factory=tuple)
    predicate: Union[ParamPredicate, Tuple[ParamPredicate, ...]] = field(default_factory=tuple)
    with_name_predicate: Union[ParamWithNamePredicate, Tuple[ParamWithNamePredicate, ...]] = field(
        default_factory=tuple)

    def matches(self, param: torch.nn.Parameter, param_name: str) -> bool:
        as_tuple = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
        return (any(fnmatch.fnmatch(param_name, p) for p in as_tuple(self.name))
                or any(getattr(param, a, False) for a in as_tuple(self.attr))
                or any(p(param) for p in as_tuple(self.predicate))
                or any(p(param, param_name) for p in as_tuple(self.with_name_predicate)))


def check_precision_aware(config):
    """Megatron's rules: 16-bit optimizer dtypes only with the precision-aware optimizer, which is Adam with the
    distributed optimizer. ``config``: an OptimizerConfig, or the parsed flags (the same attribute names), so the
    flags and the library refuse in the same words."""
    dtype = lambda name: as_optimizer_dtype(getattr(config, name))  # noqa: E731
    dtypes = {"--main-grads-dtype": (dtype("main_grads_dtype"), (torch.float32, torch.bfloat16)),
              "--main-params-dtype": (dtype("main_params_dtype"), (torch.float32, torch.float16)),
              "--exp-avg-dtype": (dtype("exp_avg_dtype"), (torch.float32, torch.bfloat16)),
              "--exp-avg-sq-dtype": (dtype("exp_avg_sq_dtype"), (torch.float32, torch.bfloat16))}
    for flag, (dtype, allowed) in dtypes.items():
        if not config.use_precision_aware_optimizer and dtype != torch.float32:
            raise ValueError(f"{flag} {_DTYPE_NAMES.get(dtype, dtype)} needs --use-precision-aware-optimizer "
                             "(without it the optimizer keeps fp32)")
        if dtype not in allowed:
            names = ", ".join(_DTYPE_NAMES[d] for d in allowed)
            # Transformer Engine keeps fp16 and fp8 moments with a scale per tensor; without one Adam's
            # squared gradients underflow fp16 (measured: the update blows up within 3 steps).
            hint = (" (fp16 and fp8 moments need a scale per tensor, not built here)"
                    if dtype in (torch.float16, torch.uint8) and "exp-avg" in flag else "")
            raise ValueError(f"{flag} {_DTYPE_NAMES.get(dtype, dtype)} is not supported: use {names}{hint}")
    if config.use_precision_aware_optimizer:
        if config.optimizer != "adam":
            raise ValueError(f"--use-precision-aware-optimizer works with --optimizer adam, not {config.optimizer}")
        if not config.use_distributed_optimizer:
            raise ValueError("--use-precision-aware-optimizer needs --use-distributed-optimizer (as in Megatron)")
