"""ModuleSpec: which class builds a submodule, with which extra kwargs and nested submodule specs.

Specs let one model class be assembled from different layer implementations (local torch vs. fused)
without the model code knowing which.
"""
import importlib
import types
from dataclasses import dataclass, field
from typing import Tuple, Union


@dataclass
class ModuleSpec:
    module: Union[Tuple, type]
    params: dict = field(default_factory=dict)
    submodules: object = None
    metainfo: dict = field(default_factory=dict)  # free-form notes about the module; not read here


def import_module(module_path: Tuple[str, str]):
    """Import ``name`` from ``module`` given ``(module, name)``."""
    base, name = module_path
    return getattr(importlib.import_module(base), name)


def get_module(spec_or_module, **additional_kwargs):
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    if isinstance(spec_or_module.module, (type, types.FunctionType)):
        return spec_or_module.module
    return import_module(spec_or_module.module)


def build_module(spec_or_module, *args, **kwargs):
    """Instantiate a spec (class + params + submodules), a class, or return a function as is."""
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    if isinstance(spec_or_module, ModuleSpec) and isinstance(spec_or_module.module, types.FunctionType):
        return spec_or_module.module
    if isinstance(spec_or_module, type):
        return spec_or_module(*args, **kwargs)
    module = (spec_or_module.module if isinstance(spec_or_module.module, type)
              else import_module(spec_or_module.module))
    if isinstance(module, types.FunctionType):
        return module
    if spec_or_module.submodules is not None:
        kwargs["submodules"] = spec_or_module.submodules
    return module(*args, **spec_or_module.params, **kwargs)
