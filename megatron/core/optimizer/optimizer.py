"""Megatron optimizer wrappers: fp32 main params/grads around a torch optimizer.

`step()` = copy model grads (`main_grad`) to the main params' `.grad` -> unscale and check for
inf/nan (fp16; the decision is all-reduced so every rank skips together) -> global norm and clip ->
count zeros -> inner step -> copy main params back to the model params. Returns
`(update_successful, grad_norm, num_zeros_in_grad)`.
"""
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies.staging import wait_for_staged_copies
from megatron.core.distributed.torch_fsdp2_state import full_local_tensor, shard_like
from megatron.core.optimizer import optimizer_state
from megatron.core.optimizer.clip_grads import (
    clip_coefficient,
    clip_grad_by_total_norm_fp32,
    count_zeros_in_grads,
    get_grad_norm_fp32,
    param_counts_for_grad_stats,
)
from megatron.core.optimizer.fused_adamw import triton_adamw_applies, triton_adamw_step
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.utils import lazy_names

# Megatron's path for the chained optimizer and its state view, defined in chained_optimizer.py (which
# wraps this module's optimizers), resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core.optimizer.chained_optimizer"
                                    for name in ("ChainedOptimizer", "ProxyDict")})


def _model_grad(param):
    return param.main_grad if hasattr(param, "main_grad") else param.grad


# The param-group keys that tell groups apart (checkpoint loading matches groups by them): the
# user-overridable ParamGroupOverride keys, then the optimizer's own structural flags.
param_group_identifier_keys = ("end_wd", "max_lr", "min_lr", "optimizer", "start_wd", "wd_mult",
                               "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def copy_optimizer_param_metadata(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Carry the tags the optimizer groups and counts params by (`allreduce`: dense or expert; `shared`:
    a tied weight; `grad_norm_group`; Muon's fused-QKV split) over to a copy or view of a param, e.g. its
    fp32 main param."""
    for attr in ("allreduce", "shared", "grad_norm_group", "is_qkv", "qkv_split_shapes"):
        if hasattr(source, attr):
            setattr(destination, attr, getattr(source, attr))


def copy_tensor_model_parallel_attributes(dst, src):
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "shared", "sequence_parallel"):
        if hasattr(src, attr):
            setattr(dst, attr, getattr(src, attr))


class MegatronOptimizer:
    """Owns a torch optimizer whose param groups hold *main* params (fp32), each mapped to a model
    param (`self.main_to_model`). Subclasses decide how main params relate to model params."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, init_state_fn=None,
                 grad_scaler=None):
        self.optimizer = optimizer
        self.config = config
        # init_state_fn(torch_optimizer, config) creates state before a save or load of a fresh optimizer;
        # params it leaves without state get zero Adam/SGD state (optimizer_state.init_state).
        self.init_state_fn = init_state_fn
        self.grad_scaler = grad_scaler
        self.main_to_model: Dict[torch.Tensor, torch.nn.Parameter] = {}

    # -- plumbing ------------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    def get_parameters(self) -> List[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def model_params(self) -> List[torch.nn.Parameter]:
        return list(dict.fromkeys(self.main_to_model.values()))

    def main_param_ranges(self):
        """(main, model param, start, end) for each fp32 main copy that is a tensor of its own (not the model
        param itself): it holds [start, end) of model.view(-1). Code that edits model weights between steps
        (QK-clip) edits these alike."""
        return [(main, model, 0, model.numel()) for main, model in self.main_to_model.items()
                if main.data_ptr() != model.data_ptr()]

    def get_grad_stats_parallel_group(self):
        """Groups to sum grad statistics over: model parallel (TP x PP); DP grads are replicas,
        except under FSDP2 where each DP rank holds a shard (DTensor params)."""
        groups = [parallel_state.get_model_parallel_group()]
        if any(hasattr(p, "to_local") for p in self.main_to_model.values()):
            groups.append(parallel_state.get_data_parallel_group(with_context_parallel=True))
        return groups

    def _timer(self, name):
        timers = self.config.timers
        return None if timers is None else timers(name, log_level=1)

    @contextmanager
    def _timed(self, name):
        timer = self._timer(name)
        if timer is not None:
            timer.start(barrier=self.config.barrier_with_L1_time)
        try:
            yield
        finally:
            if timer is not None:
                timer.stop()

    # -- loss scaling --------------------------------------------------------------------------
    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is None:
            return torch.tensor(1.0)
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # The scale lives on the host: multiply by its value (no host-to-device copy, which a CUDA
        # graph capture forbids), and not at all without a scaler.
        if self.grad_scaler is None:
            return loss
        return loss * float(self.get_loss_scale())

    # -- grad statistics -----------------------------------------------------------------------
    # Set for MoE models (same on every rank): expert grads are then counted over the expert groups.
    has_expert_params = False

    def get_expert_grad_stats_parallel_group(self):
        """Expert params differ across expert-TP, EP and PP ranks and repeat over expert-DP."""
        return [parallel_state.get_expert_tensor_model_pipeline_parallel_group()]

    def _main_grads_for_stats(self, expert=None) -> List[torch.Tensor]:
        return [g for p in self.get_parameters()
                if (g := self._main_grad(p)) is not None and param_counts_for_grad_stats(self.main_to_model[p])
                and (expert is None or expert == (not getattr(self.main_to_model[p], "allreduce", True)))]

    def get_grad_norm(self, as_tensor: bool = False):
        """The global grad norm: a float, or with ``as_tensor`` a float64 device scalar (no host sync) whose
        value is that float's."""
        if not self.has_expert_params:
            return get_grad_norm_fp32(self._main_grads_for_stats(), as_tensor=as_tensor,
                                      grad_stats_parallel_group=self.get_grad_stats_parallel_group())
        # Each element once: dense over the dense groups, experts over the expert groups.
        dense = get_grad_norm_fp32(self._main_grads_for_stats(expert=False), as_tensor=as_tensor,
                                   grad_stats_parallel_group=self.get_grad_stats_parallel_group())
        expert = get_grad_norm_fp32(self._main_grads_for_stats(expert=True), as_tensor=as_tensor,
                                    grad_stats_parallel_group=self.get_expert_grad_stats_parallel_group())
        return (dense ** 2 + expert ** 2) ** 0.5

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Global grad norm (before clipping); clips the grads Adam will read when it exceeds clip_grad.

        With torch's fused Adam the clip reaches the kernel as its ``grad_scale`` (grads are divided by
        it as they are read) instead of a separate in-place pass over the fp32 grads. Only when the clip
        is active: the fused kernel also writes the divided grads back, which costs more than nothing.
        """
        if clip_grad > 0.0 and self._inner_step_unscales_grads():
            copies = self._triton_step_copies()
            if copies is not None:
                # The Triton AdamW divides by the scale as it reads the grads and writes nothing back, so
                # the clip can stay on the device: the norm reaches the host after the update is queued
                # (step()), not before, where the GPU would idle while the host launches the update.
                grad_norm = self.get_grad_norm(as_tensor=True)
                coeff = clip_grad / (grad_norm + 1.0e-6)  # clip_coefficient's arithmetic, in float64
                self._clip_grad_scale = torch.where(coeff < 1.0, 1.0 / coeff, 1.0).float()
                self._triton_copies = copies
                return grad_norm
        grad_norm = self.get_grad_norm()
        if clip_grad > 0.0:
            coeff = clip_coefficient(clip_grad, grad_norm)
            if coeff < 1.0 and self._inner_step_unscales_grads():
                device = self.get_parameters()[0].device
                self._clip_grad_scale = torch.tensor(1.0 / coeff, dtype=torch.float32, device=device)
            else:
                clip_grad_by_total_norm_fp32(self.get_parameters(), clip_grad, grad_norm,
                                             use_decoupled_grad=self._decoupled_grads)
        return grad_norm

    def _inner_step_unscales_grads(self) -> bool:
        """True for torch's fused Adam/AdamW (what CUDA runs get), which take a `grad_scale` to divide
        grads by; not for DTensor (FSDP2) params."""
        inner = self.optimizer
        return (isinstance(inner, torch.optim.Adam) and bool(inner.defaults.get("fused"))
                and self.grad_scaler is None and len(self.get_parameters()) > 0
                and not any(hasattr(p, "to_local") for p in self.get_parameters()))

    def _inner_step(self) -> bool:
        """The inner optimizer's step (dividing grads by a pending clip factor); True when it also wrote
        the 16-bit model params, so no copy pass is needed (the Triton AdamW of `fused_adamw`)."""
        scale = getattr(self, "_clip_grad_scale", None)
        self._clip_grad_scale = None
        copies = self.__dict__.pop("_triton_copies", None)  # found by clip_grad_norm this step
        if copies is None:
            copies = self._triton_step_copies()
        if copies is not None:
            triton_adamw_step(self.optimizer, copies, scale)
            return True
        if scale is None:
            self.optimizer.step()
            return False
        self.optimizer.grad_scale = scale
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale
        return False

    def _triton_step_copies(self) -> Optional[Dict[torch.Tensor, Optional[torch.Tensor]]]:
        """`_model_param_copies` when the Triton AdamW computes this step (CUDA, fused AdamW, no loss
        scaler), else None."""
        if self.grad_scaler is not None or not triton_adamw_applies(self.optimizer):
            return None
        return self._model_param_copies()

    def _model_param_copies(self) -> Optional[Dict[torch.Tensor, Optional[torch.Tensor]]]:
        """{main param: the contiguous 16-bit model tensor its update is copied into (None: main is the
        model param)}, or None when some copy target is not a plain contiguous tensor."""
        return {}

    def count_zeros(self) -> float:
        if not self.has_expert_params:
            return count_zeros_in_grads(self._main_grads_for_stats(), self.get_grad_stats_parallel_group())
        return (count_zeros_in_grads(self._main_grads_for_stats(expert=False), self.get_grad_stats_parallel_group())
                + count_zeros_in_grads(self._main_grads_for_stats(expert=True),
                                   self.get_expert_grad_stats_parallel_group()))

    def _unscale_and_check_for_inf(self) -> bool:
        """Unscale main grads by 1/loss_scale; True if any rank of the stats groups saw inf/nan."""
        inv_scale = self.grad_scaler.inv_scale
        found = torch.zeros(1, dtype=torch.float32)
        grads = [g for p in self.get_parameters() if (g := self._main_grad(p)) is not None]
        for g in grads:
            g.mul_(inv_scale.to(g.device))
            if not torch.isfinite(g.to_local() if hasattr(g, "to_local") else g).all():
                found.fill_(1.0)
        device = grads[0].device if grads else found.device
        if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
            if device.type == "cpu" and dist.get_backend() == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            found = found.to(device)
            groups = self.get_grad_stats_parallel_group()
            if self.has_expert_params:
                groups = groups + self.get_expert_grad_stats_parallel_group()
            for group in groups:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    # -- the step ------------------------------------------------------------------------------
    def _copy_model_grads_to_main_grads(self):
        raise NotImplementedError

    def _copy_main_params_to_model_params(self):
        raise NotImplementedError

    def _after_step(self):
        """Hook for subclasses (the distributed optimizer all-gathers params here)."""

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[float]]:
        wait_for_staged_copies()  # an async checkpoint's copy of the params and state must finish first
        with self._timed("optimizer-copy-to-main-grad"):
            self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            with self._timed("optimizer-unscale-and-check-inf"):
                found_inf = self._unscale_and_check_for_inf()
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        with self._timed("optimizer-clip-main-grad"):
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = None
        if self.config.log_num_zeros_in_grad:
            with self._timed("optimizer-count-zeros"):
                num_zeros = self.count_zeros()
        with self._timed("optimizer-inner-step"):
            copied = self._inner_step()
        if not copied:
            with self._timed("optimizer-copy-main-to-model-params"):
                self._copy_main_params_to_model_params()
        self._after_step()
        if torch.is_tensor(grad_norm):  # kept on the device until the update was queued
            grad_norm = grad_norm.item()
        return True, grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True):
        """Drop model `.grad`s and main grads (DDP's `zero_grad_buffer` zeroes `main_grad`)."""
        for param in self.model_params():
            param.grad = None
        for param in self.get_parameters():
            param.grad = None
            if hasattr(param, "decoupled_grad"):
                param.decoupled_grad = None

    @property
    def _decoupled_grads(self) -> bool:
        """The precision-aware optimizer's main grads are ``main.decoupled_grad`` (as in Megatron): a bf16 grad of
        an fp32 main param cannot be its ``.grad``, whose dtype torch ties to the param's."""
        return bool(getattr(self.config, "use_precision_aware_optimizer", False))

    def _main_grad(self, main):
        return getattr(main, "decoupled_grad", None) if self._decoupled_grads else main.grad

    def reload_model_params(self):
        """Refresh main params from the model params (after loading a model checkpoint)."""
        raise NotImplementedError

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        sd = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        sd.update(self._extra_state_dict())
        return sd

    def _extra_state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state_dict: Dict):
        if state_dict.get("param_state_sharding_type") is not None:
            optimizer_state.load_sharded(self, state_dict)
            return
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self._load_extra_state_dict(state_dict)

    def _load_extra_state_dict(self, state_dict: Dict):
        pass

    def sharded_state_dict(self, model_sharded_state_dict: Dict, is_loading: bool = False) -> Dict:
        """Optimizer state under the model params' global keys, shapes and offsets (reshardable)."""
        return optimizer_state.sharded_state_dict(self, model_sharded_state_dict, is_loading)

    # Per-model-param full state (the model param's local TP shard shape); overridden by DistOpt.
    def param_state_for_save(self) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
        optimizer_state.init_state(self)
        out = {}
        for main, model in self.main_to_model.items():
            state = {k: v for k, v in self.optimizer.state[main].items() if k != "step"}
            if main is not model:
                state["fp32_param"] = main.detach()
            # FSDP2: whole local-TP tensors, like the model's sharded_state_dict (collective over DP).
            out[model] = {k: full_local_tensor(v) for k, v in state.items()}
        return out

    def set_param_state_from_load(self, model_param_state: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]):
        optimizer_state.init_state(self)
        for main, model in self.main_to_model.items():
            loaded = model_param_state.get(model)
            if loaded is None:
                continue
            for key, value in loaded.items():
                if key == "fp32_param":
                    main.detach().copy_(shard_like(value, main).view_as(main))
                elif key in self.optimizer.state[main]:
                    target = self.optimizer.state[main][key]
                    target.copy_(shard_like(value, target).view_as(target))
        self._copy_main_params_to_model_params()


class MixedPrecisionOptimizer(MegatronOptimizer):
    """A MegatronOptimizer whose grads may need loss scaling: fp16 requires a `grad_scaler`; bf16 and
    fp32 may go without one. Base of the fp16/bf16 and distributed optimizers."""

    def __init__(self, optimizer, config, grad_scaler, init_state_fn):
        if grad_scaler is None and config.fp16:
            raise ValueError("fp16 training needs a grad scaler (OptimizerConfig.loss_scale or dynamic scaling)")
        super().__init__(optimizer, config, init_state_fn=init_state_fn, grad_scaler=grad_scaler)


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """bf16/fp16 model params with fp32 main copies (fp32 model params are their own main params)."""

    def __init__(self, optimizer, config, grad_scaler=None, init_state_fn=None):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        for group in self.optimizer.param_groups:
            mains = []
            for param in group["params"]:
                if param.dtype in (torch.float16, torch.bfloat16):
                    main = param.detach().clone().float()
                    copy_tensor_model_parallel_attributes(main, param)
                    copy_optimizer_param_metadata(main, param)
                    param.main_param = main
                else:
                    main = param
                self.main_to_model[main] = param
                mains.append(main)
            group["params"] = mains

    def _copy_model_grads_to_main_grads(self):
        for main, model in self.main_to_model.items():
            grad = _model_grad(model)
            if grad is None:
                main.grad = None
            elif main is model:
                main.grad = grad if grad.dtype == torch.float32 else grad.float()
            else:
                main.grad = grad.float()

    def _model_param_copies(self):
        copies = {}
        for main, model in self.main_to_model.items():
            if main is not model:
                if not model.data.is_contiguous() or model.data.numel() != main.numel():
                    return None
                copies[main] = model.data
        return copies

    def _copy_main_params_to_model_params(self):
        pairs = [(main, model) for main, model in self.main_to_model.items() if main is not model]
        if pairs and pairs[0][1].is_cuda:
            # One multi-tensor kernel instead of a cast-copy launch per parameter.
            torch._foreach_copy_([model.data for _, model in pairs], [main.data for main, _ in pairs])
            return
        for main, model in pairs:
            model.data.copy_(main.data)

    def reload_model_params(self):
        for main, model in self.main_to_model.items():
            if main is not model:
                main.data.copy_(model.data)


class FP32Optimizer(Float16OptimizerWithFloat16Params):
    """fp32 model: main params are the model params themselves; no loss scaling."""

    def __init__(self, optimizer, config, init_state_fn=None, grad_scaler=None):
        super().__init__(optimizer, config, grad_scaler=grad_scaler, init_state_fn=init_state_fn)
        assert all(m is p for m, p in self.main_to_model.items()), "FP32Optimizer got non-fp32 params"
