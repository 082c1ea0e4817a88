"""MegatronModule (config holder + layout-independent checkpoint description) and Float16Module."""
from typing import Optional

import torch

from megatron.core import parallel_state


class MegatronModule(torch.nn.Module):
    """Base class of Megatron modules: keeps ``config`` and describes its state as ShardedTensors."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def set_is_first_microbatch(self):
        for m in self.modules():
            if hasattr(m, "is_first_microbatch"):
                m.is_first_microbatch = True

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """``{local state-dict key: ShardedTensor(key=global name)}`` for every param and persistent buffer."""
        if sharded_offsets:
            raise NotImplementedError("sharded_offsets are not supported; call on the model root")
        if getattr(self, "pg_collection", None) is not None:
            raise NotImplementedError(f"{type(self).__name__}.sharded_state_dict: the checkpoint layout follows "
                                      "parallel_state's ranks, not the explicit pg_collection the model is built on")
        # lazy: sharded_state imports torch.distributed.checkpoint, ~0.9 s that building a model never needs
        from megatron.core.transformer.sharded_state import build_sharded_state_dict  # lazy: see above
        return build_sharded_state_dict(self, prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As torch's, but tensors saved under a reshaped view (SwiGLU fc1 as [2, f, h]) are reshaped back."""
        own = self.state_dict(keep_vars=True)
        fixed = {}
        for key, value in state_dict.items():
            target = own.get(key)
            if (torch.is_tensor(value) and torch.is_tensor(target) and value.shape != target.shape
                    and value.numel() == target.numel()):
                value = value.reshape(target.shape)
            fixed[key] = value
        return super().load_state_dict(fixed, strict=strict, assign=assign)


def _convert_floats(values, fn):
    """Apply ``fn`` to every floating tensor in a nested tuple/list/dict."""
    if torch.is_tensor(values):
        return fn(values) if values.is_floating_point() else values
    if isinstance(values, (tuple, list)):
        return type(values)(_convert_floats(v, fn) for v in values)
    if isinstance(values, dict):
        return {k: _convert_floats(v, fn) for k, v in values.items()}
    return values


class Float16Module(MegatronModule):
    """Runs ``module`` in fp16/bf16: params cast once; float inputs cast on the first stage, outputs
    cast back to fp32 on the last stage (so losses are reduced in fp32)."""

    def __init__(self, config, module: torch.nn.Module):
        super().__init__(config)
        if config.fp16:
            self.dtype = torch.float16
        elif config.bf16:
            self.dtype = torch.bfloat16
        else:
            raise ValueError("Float16Module needs --fp16 or --bf16")
        self.add_module("module", module.to(self.dtype))

    def set_input_tensor(self, input_tensor):
        return self.module.set_input_tensor(input_tensor)

    def _is_first(self):
        pre = getattr(self.module, "pre_process", None)
        return parallel_state.is_pipeline_first_stage() if pre is None else pre

    def _is_last(self):
        post = getattr(self.module, "post_process", None)
        return parallel_state.is_pipeline_last_stage() if post is None else post

    def forward(self, *inputs, **kwargs):
        if self._is_first():
            inputs = _convert_floats(inputs, lambda t: t.to(self.dtype))
            kwargs = _convert_floats(kwargs, lambda t: t.to(self.dtype))
        outputs = self.module(*inputs, **kwargs)
        if self._is_last():
            outputs = _convert_floats(outputs, lambda t: t.float())
        return outputs

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def param_is_not_shared(param) -> bool:
    """False for params marked `shared` (e.g. a tied output weight that another module owns)."""
    return not getattr(param, "shared", False)


def conversion_helper(val, conversion):
    """Apply `conversion` to `val`, or to each element of a (nested) tuple/list, keeping the types."""
    if not isinstance(val, (tuple, list)):
        return conversion(val)
    return type(val)(conversion_helper(v, conversion) for v in val)


def fp32_to_float16(val, float16_convertor):
    """fp32 tensors (also inside tuples/lists) -> `float16_convertor(tensor)`; the rest unchanged."""
    def convert(v):
        data = v.data if isinstance(v, torch.nn.Parameter) else v
        return float16_convertor(v) if torch.is_tensor(data) and data.dtype == torch.float32 else v
    return conversion_helper(val, convert)


def float16_to_fp32(val):
    """fp16/bf16 tensors (also inside tuples/lists) -> fp32; the rest unchanged."""
    def convert(v):
        data = v.data if isinstance(v, torch.nn.Parameter) else v
        return v.float() if torch.is_tensor(data) and data.dtype in (torch.float16, torch.bfloat16) else v
    return conversion_helper(val, convert)
