"""Activation functions that model configs name by reference (Megatron's ``megatron.core.activations``)."""
import torch
import torch.nn.functional as F


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): OpenAI CLIP's GeLU approximation (HF ``quick_gelu``)."""
    return x * torch.sigmoid(1.702 * x)


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation (SigLIP's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer's activation, ``--squared-relu``)."""
    return torch.pow(F.relu(x), 2)
