"""Configuration of the optimizer (Megatron Core's `OptimizerConfig`)."""
import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple, Union

import torch

from megatron.core._compat_fields import check_compat_fields
from megatron.core.optimizer._compat_fields import OptimizerConfigCompat


@dataclass
class OptimizerConfig(OptimizerConfigCompat):
    optimizer: str = "adam"
    """'adam' (AdamW: decoupled weight decay) or 'sgd'."""

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
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"--optimizer {self.optimizer} is not supported; use adam or sgd")
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive; pick one")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather requires --use-distributed-optimizer")
        if self.overlap_param_gather_with_optimizer_step:
            raise NotImplementedError(
                "--overlap-param-gather-with-optimizer-step is not supported; use --overlap-param-gather")
        if self.clip_grad < 0:
            raise ValueError("--clip-grad must be >= 0 (0 disables clipping)")



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
