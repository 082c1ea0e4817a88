"""Learning-rate and weight-decay schedules; counts samples, as Megatron does.

`step(increment)` advances by `increment` samples (the global batch size per successful iteration);
iteration-based horizons are passed in already multiplied by the global batch size.
"""
import logging
import math
from typing import Optional, TypedDict

from megatron.core.utils import lazy_names

# Megatron's LR-for-logging helper, which the log line here does not call, resolved on first use.
__getattr__ = lazy_names(__name__, {"get_canonical_lr_for_logging": "megatron.core._compat.optimizer_param_scheduler"})

logger = logging.getLogger(__name__)

_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
_WD_STYLES = ("constant", "linear", "cosine")


class ParamGroupOverride(TypedDict, total=False):
    """Megatron's per-param-group override keys (a type), read from each group by the scheduler: max_lr,
    min_lr (get_lr), start_wd, end_wd (get_wd), wd_mult (step); `optimizer` must equal the config's."""
    max_lr: float
    min_lr: float
    start_wd: float
    end_wd: float
    wd_mult: float
    optimizer: str


def combine_param_group_overrides(param_group_overrides) -> ParamGroupOverride:
    """Merge the overrides of every ParamKey a param matches (None entries skipped); a key set to two
    different values is a conflict."""
    combined = ParamGroupOverride()
    for override in param_group_overrides:
        for key, value in (override or {}).items():
            if key in combined and combined[key] != value:
                raise ValueError(f"Conflicting overrides for {key}: {combined[key]} and {value}")
            combined[key] = value
    return combined


def param_group_override_to_tuple(param_group_override: Optional[ParamGroupOverride]):
    """A hashable form of an override (its items sorted by key), None for None: to group params by it."""
    return None if param_group_override is None else tuple(sorted(param_group_override.items()))


class OptimizerParamScheduler:
    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float, wd_incr_steps: int,
                 wd_incr_style: str, use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False, wsd_decay_steps: Optional[int] = None,
                 lr_wsd_decay_style: Optional[str] = None):
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = float(init_lr), float(max_lr), float(min_lr)
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"--min-lr ({min_lr}) must be in [0, --lr ({max_lr})]")
        if self.init_lr > self.max_lr:
            raise ValueError(f"--lr-warmup-init ({init_lr}) must be <= --lr ({max_lr})")
        if lr_decay_steps <= 0:
            raise ValueError("the LR decay horizon (--lr-decay-iters/--lr-decay-samples) must be positive")
        if lr_warmup_steps >= lr_decay_steps:
            raise ValueError(f"LR warmup ({lr_warmup_steps}) must be shorter than the decay horizon ({lr_decay_steps})")
        if lr_decay_style not in _DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {lr_decay_style} unknown; choose from {', '.join(_DECAY_STYLES)}")
        if lr_decay_style == "WSD":
            if wsd_decay_steps is None or lr_wsd_decay_style not in _WSD_STYLES:
                raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters/samples and --lr-wsd-decay-style "
                                 f"in {', '.join(_WSD_STYLES)}")
        if wd_incr_style not in _WD_STYLES:
            raise ValueError(f"--weight-decay-incr-style {wd_incr_style} unknown; choose from {', '.join(_WD_STYLES)}")
        if not 0.0 <= start_wd <= end_wd:
            raise ValueError("--start-weight-decay must be in [0, --end-weight-decay]")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError("--weight-decay-incr-style constant needs --start-weight-decay == --end-weight-decay")
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are exclusive")
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_wd(self, param_group: Optional[dict] = None) -> float:
        """Weight decay at `num_steps`: start_wd -> end_wd over wd_incr_steps, then end_wd (a group's own
        start_wd / end_wd when it has them)."""
        group = param_group or {}
        start_wd, end_wd = group.get("start_wd", self.start_wd), group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def get_lr(self, param_group: dict) -> float:
        """LR at `num_steps` for a group (its own max_lr/min_lr when set)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(self.num_steps, 1)))
        ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff()
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self) -> float:
        """Warmup-stable-decay: 1 until the last `wsd_decay_steps`, then anneal to 0."""
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= anneal_start:
            return 1.0
        ratio = (self.num_steps - anneal_start) / self.wsd_decay_steps
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt

    def step(self, increment: int):
        """Advance by `increment` samples and set every group's lr and weight_decay."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.lr_warmup_steps, "num_steps": self.num_steps,
                "lr_decay_style": self.lr_decay_style, "lr_decay_steps": self.lr_decay_steps,
                "min_lr": self.min_lr, "start_wd": self.start_wd, "end_wd": self.end_wd,
                "wd_incr_style": self.wd_incr_style, "wd_incr_steps": self.wd_incr_steps}

    def _check_and_set(self, cls_value, sd_value, name: str):
        """Class value wins with --override-opt_param-scheduler; otherwise they must agree unless the
        checkpoint's values are used (--use-checkpoint-opt_param-scheduler)."""
        if self.override_opt_param_scheduler:
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(f"OptimizerParamScheduler: {name} is {cls_value} but the checkpoint has {sd_value}; "
                             "pass --use-checkpoint-opt_param-scheduler or --override-opt_param-scheduler")
        logger.info(" > using checkpoint value %s for %s", sd_value, name)
        return sd_value

    def load_state_dict(self, sd: dict):
        # Older checkpoints used other names for the same fields.
        max_lr = sd["start_lr"] if "start_lr" in sd else sd["max_lr"]
        self.max_lr = self._check_and_set(self.max_lr, max_lr, "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "minimum learning rate")
        warmup = sd["warmup_iter"] if "warmup_iter" in sd else sd.get("warmup_steps", sd.get("lr_warmup_steps"))
        self.lr_warmup_steps = self._check_and_set(self.lr_warmup_steps, warmup, "warmup iterations")
        decay = sd["end_iter"] if "end_iter" in sd else sd.get("decay_steps", sd.get("lr_decay_steps"))
        self.lr_decay_steps = self._check_and_set(self.lr_decay_steps, decay, "total number of iterations")
        style = sd["decay_style"] if "decay_style" in sd else sd["lr_decay_style"]
        self.lr_decay_style = self._check_and_set(self.lr_decay_style, style, "learning rate decay style")
        num_steps = sd["num_iters"] if "num_iters" in sd else sd["num_steps"]
        if "start_wd" in sd:
            self.start_wd = self._check_and_set(self.start_wd, sd["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, sd["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(self.wd_incr_steps, sd["wd_incr_steps"],
                                                     "total number of weight decay iterations")
            self.wd_incr_style = self._check_and_set(self.wd_incr_style, sd["wd_incr_style"],
                                                     "weight decay incr style")
        self.num_steps = 0
        self.step(increment=num_steps)
