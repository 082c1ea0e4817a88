"""Activation functions that model configs name by reference (Megatron's ``megatron.core.activations``)."""
import torch
import torch.nn.functional as F


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): OpenAI CLIP's GeLU approximation (HF ``quick_gelu``)."""
    return x * torch.sigmoid(1.702 * x)


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation (SigLIP's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


def glu(x: torch.Tensor, activation_func, linear_offset: float = 0.0, clamp_value=None) -> torch.Tensor:
    """activation(gate) * (up + linear_offset) over ``x`` = [gate; up] along the last dim. With ``clamp_value``
    the gate is clamped to at most it and up to [-clamp_value, clamp_value] first: gpt-oss's clamped GLU
    (Megatron's ``glu_linear_offset`` and ``activation_func_clamp_value``)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    if clamp_value is not None:
        gate = gate.clamp(max=clamp_value)
        up = up.clamp(min=-clamp_value, max=clamp_value)
    return activation_func(gate) * (up + linear_offset if linear_offset else up)


def glu_extras(config) -> bool:
    """The config's GLU has an offset or a clamp, which the fused SwiGLU kernels do not compute."""
    return bool(getattr(config, "glu_linear_offset", 0.0)) or getattr(config, "activation_func_clamp_value",
                                                                          None) is not None


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer's activation, ``--squared-relu``)."""
    return torch.pow(F.relu(x), 2)
