"""ModuleSpec: which class builds a submodule, with which extra kwargs and nested submodule specs.

Specs let one model class be assembled from different layer implementations (local torch vs. fused)
without the model code knowing which.
"""
import functools
import importlib
import inspect
import types
from dataclasses import dataclass, field
from typing import Tuple, Union


@dataclass
class ModuleSpec:
    module: Union[Tuple, type]
    params: dict = field(default_factory=dict)
    submodules: object = None
    metainfo: dict = field(default_factory=dict)  # free-form notes about the module; not read here

    def __call__(self, *args, **kwargs):
        """Build the module: ``spec(config, ...)`` is ``build_module(spec, config, ...)``, as in Megatron."""
        return build_module(self, *args, **kwargs)


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


def process_group_kwargs(spec, pg_collection, owner: str) -> dict:
    """The keyword that hands explicit process groups to the submodule ``spec`` builds: ``pg_collection``
    where its constructor names it (or takes only ``*args, **kwargs``: it forwards them, or ignores them as
    IdentityOp does), the TP group as ``tp_group`` where it names that (MLP). None (parallel_state's
    groups): no keyword, so the default build is unchanged. A module taking neither cannot honour explicit
    groups and is refused in one line rather than left on parallel_state's."""
    if pg_collection is None or spec is None:
        return {}
    module = get_module(spec)
    if isinstance(module, types.FunctionType):
        return {}  # a function (e.g. bias-dropout-add) builds nothing
    params = inspect.signature(module).parameters
    if "pg_collection" in params:
        return {"pg_collection": pg_collection}
    if "tp_group" in params:
        return {"tp_group": pg_collection.tp}
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        return {"pg_collection": pg_collection}
    raise NotImplementedError(f"{owner}(pg_collection=...): its submodule {module.__name__} takes neither "
                              "pg_collection nor tp_group, so it cannot run on explicit process groups")


def get_submodules(spec):
    """The ``submodules`` a spec builds with: a ModuleSpec's (or any object's) attribute, or the
    ``submodules=`` keyword bound in a functools.partial. Raises ValueError when there is none."""
    if isinstance(spec, functools.partial):
        if "submodules" in spec.keywords:
            return spec.keywords["submodules"]
    elif hasattr(spec, "submodules"):
        return spec.submodules
    raise ValueError(f"spec {spec!r} has no submodules")
