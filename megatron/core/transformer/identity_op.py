"""Placeholders for optional submodules (e.g. no q_layernorm)."""
import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input unchanged; accepts and ignores constructor arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """Returns the identity function, for specs whose slot is called as a factory (e.g. bda)."""

    def forward(self, *args, **kwargs):
        return lambda x: x
