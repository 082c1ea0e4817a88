"""Loss scalers for fp16 training: a constant scale, or Megatron's dynamic scale with hysteresis."""
from abc import ABC, abstractmethod
from typing import Dict

import torch


class MegatronGradScaler(ABC):
    def __init__(self, initial_scale: float):
        if initial_scale <= 0.0:
            raise ValueError("--initial-loss-scale / --loss-scale must be positive")
        self._scale = torch.tensor(float(initial_scale), dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool):
        ...

    @abstractmethod
    def state_dict(self) -> Dict:
        ...

    @abstractmethod
    def load_state_dict(self, state_dict: Dict):
        ...


class ConstantGradScaler(MegatronGradScaler):
    """`--loss-scale S`: the scale never changes (overflowing steps are still skipped)."""

    def update(self, found_inf: bool):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Grow by `growth_factor` after `growth_interval` clean steps; shrink by `backoff_factor` once
    `hysteresis` overflows have occurred since the last growth (never below `min_scale`)."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, hysteresis: int):
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError("--min-loss-scale must be positive and <= --initial-loss-scale")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("loss-scale growth factor must be > 1 and backoff factor in (0, 1)")
        if growth_interval <= 0 or hysteresis <= 0:
            raise ValueError("--loss-scale-window and --hysteresis must be positive")
        self.min_scale = torch.tensor(float(min_scale), dtype=torch.float32)
        self.growth_factor = torch.tensor(float(growth_factor), dtype=torch.float32)
        self.backoff_factor = torch.tensor(float(backoff_factor), dtype=torch.float32)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self):
        return {"scale": self._scale.clone(), "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict):
        self._scale = state_dict["scale"].detach().clone().float().cpu().reshape(())
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
