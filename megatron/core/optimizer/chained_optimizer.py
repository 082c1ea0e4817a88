"""ChainedOptimizer: several MegatronOptimizers (e.g. dense and expert params, or two optimizer
types) stepped as one, with one global gradient norm and one clip coefficient."""
import math
from contextlib import contextmanager
from typing import Dict, List

import torch

from megatron.core.dist_checkpointing.strategies.staging import wait_for_staged_copies
from megatron.core.optimizer.clip_grads import clip_coefficient, clip_grad_by_total_norm_fp32


class ProxyDict:
    """A dict view over a list of dicts, keyed (index, inner key): ChainedOptimizer.state, where the
    inner optimizers' states stay separate."""

    def __init__(self, inner_dicts: List[dict]):
        self._inner_dicts = inner_dicts

    def __getitem__(self, key):
        idx, inner_key = key
        return self._inner_dicts[idx].get(inner_key)

    def __setitem__(self, key, value):
        idx, inner_key = key
        self._inner_dicts[idx][inner_key] = value

    def __len__(self) -> int:
        return sum(len(d) for d in self._inner_dicts)

    def __iter__(self):
        for idx, inner in enumerate(self._inner_dicts):
            for inner_key in inner:
                yield idx, inner_key

    def items(self):
        for idx, inner in enumerate(self._inner_dicts):
            for inner_key, value in inner.items():
                yield (idx, inner_key), value


class ChainedOptimizer:
    """Steps `chained_optimizers` together: a skipped step (inf/nan in any) skips all of them; the
    grad norm is the L2 norm over all their grads and each clips with it."""

    def __init__(self, chained_optimizers: List):
        self.chained_optimizers = list(chained_optimizers)
        self.config = self.chained_optimizers[0].config if self.chained_optimizers else None

    @property
    def param_groups(self) -> List[Dict]:
        return [g for opt in self.chained_optimizers for g in opt.param_groups]

    @property
    def state(self):
        """The inner optimizers' states as one mapping keyed (optimizer index, param)."""
        return ProxyDict([opt.state for opt in self.chained_optimizers])

    def get_parameters(self) -> List[torch.Tensor]:
        return [p for opt in self.chained_optimizers for p in opt.get_parameters()]

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self.chained_optimizers[0].get_loss_scale()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.chained_optimizers[0].scale_loss(loss)

    def reload_model_params(self):
        for opt in self.chained_optimizers:
            opt.reload_model_params()

    def main_param_ranges(self):
        return [r for opt in self.chained_optimizers for r in opt.main_param_ranges()]

    def get_grad_norm(self) -> float:
        return math.sqrt(sum(opt.get_grad_norm() ** 2 for opt in self.chained_optimizers))

    @contextmanager
    def _timed(self, name):
        """The first optimizer's timer (the config's `timers`, as MegatronOptimizer.step times its phases)."""
        with self.chained_optimizers[0]._timed(name):
            yield

    @torch.no_grad()
    def step(self):
        """(update_successful, grad_norm, num_zeros_in_grad), as MegatronOptimizer.step, with its timers."""
        wait_for_staged_copies()  # an async checkpoint's copy of the params and state must finish first
        found_inf = False
        with self._timed("optimizer-copy-to-main-grad"):
            for opt in self.chained_optimizers:
                opt._copy_model_grads_to_main_grads()
        for opt in self.chained_optimizers:
            if opt.grad_scaler is not None:
                inf = opt._unscale_and_check_for_inf()
                opt.grad_scaler.update(inf)
                found_inf = found_inf or inf
        if found_inf:
            return False, None, None
        with self._timed("optimizer-clip-main-grad"):
            grad_norm = self.get_grad_norm()
            for opt in self.chained_optimizers:
                if opt.config.clip_grad > 0.0:
                    coeff = clip_coefficient(opt.config.clip_grad, grad_norm)
                    if coeff < 1.0 and opt._inner_step_unscales_grads():  # folded into the fused Adam's read
                        device = opt.get_parameters()[0].device
                        opt._clip_grad_scale = torch.tensor(1.0 / coeff, dtype=torch.float32, device=device)
                    else:
                        clip_grad_by_total_norm_fp32(opt.get_parameters(), opt.config.clip_grad, grad_norm)
        num_zeros = None
        if self.config.log_num_zeros_in_grad:
            num_zeros = sum(opt.count_zeros() for opt in self.chained_optimizers)
        for opt in self.chained_optimizers:
            with self._timed("optimizer-inner-step"):
                copied = opt._inner_step()
            if not copied:
                with self._timed("optimizer-copy-main-to-model-params"):
                    opt._copy_main_params_to_model_params()
            opt._after_step()
        return True, grad_norm, num_zeros

    def state_dict(self) -> List[Dict]:
        return [opt.state_dict() for opt in self.chained_optimizers]

    def load_state_dict(self, state_dict):
        """The list `state_dict()` returns, or the {index: state} dict of `sharded_state_dict`, loaded."""
        if isinstance(state_dict, dict):
            state_dict = [state_dict[i] for i in sorted(state_dict)]
        if len(state_dict) != len(self.chained_optimizers):
            raise ValueError(f"ChainedOptimizer: checkpoint has {len(state_dict)} optimizer states, this "
                             f"optimizer chains {len(self.chained_optimizers)}")
        for opt, sd in zip(self.chained_optimizers, state_dict):
            opt.load_state_dict(sd)

    def sharded_state_dict(self, model_sharded_state_dict: Dict, is_loading: bool = False, **kwargs) -> Dict:
        """{index: that optimizer's sharded state dict} (their params, hence keys, are disjoint)."""
        return {i: opt.sharded_state_dict(model_sharded_state_dict, is_loading)
                for i, opt in enumerate(self.chained_optimizers)}
