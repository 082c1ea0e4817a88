"""What every data-parallel wrapper (DDP, FSDP2) forwards to the model it wraps."""
import torch


class WrappedModule(torch.nn.Module):
    """State dicts and the pipeline input go to ``self.module``, so checkpoints and schedules see the
    bare model's keys whatever wraps it."""

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix: str = "", *args, **kwargs):
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def set_input_tensor(self, input_tensor):
        return self.module.set_input_tensor(input_tensor)
