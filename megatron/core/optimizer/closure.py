"""torch.optim's closure convention for the optimizers written here (Lion, the precision-aware AdamW)."""
import torch


def closure_loss(closure):
    """The loss of ``closure`` (re-evaluated with gradients on, as torch's optimizers do), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
