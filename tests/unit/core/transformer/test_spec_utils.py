"""ModuleSpec is callable, as Megatron's: ``spec(*args, **kwargs)`` builds the module like build_module."""
import torch

from megatron.core.transformer.spec_utils import ModuleSpec, build_module


class _Scaled(torch.nn.Module):
    def __init__(self, width, scale=1.0, submodules=None):
        super().__init__()
        self.width, self.scale, self.submodules = width, scale, submodules


def test_calling_a_spec_builds_its_module():
    spec = ModuleSpec(module=_Scaled, params={"scale": 2.0}, submodules="inner")
    built = spec(4)
    assert isinstance(built, _Scaled) and (built.width, built.scale, built.submodules) == (4, 2.0, "inner")
    by_path = ModuleSpec(module=("torch.nn", "Linear"))(3, 2, bias=False)
    assert isinstance(by_path, torch.nn.Linear) and by_path.bias is None
    def act(x):
        return x
    assert ModuleSpec(module=act)() is act is build_module(ModuleSpec(module=act))  # a function spec: the function
