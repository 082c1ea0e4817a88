"""--yaml-cfg FILE: Megatron's YAML layout mapped onto the flags namespace.

Megatron's layout (its examples/gpt3/gpt_config.yaml): a `language_model:` section of TransformerConfig
fields, a `model_parallel:` section of ModelParallelConfig fields, and top-level keys named like the flags'
dests (`micro_batch_size`, `lr`, `data_path` ...). `${VAR}` inside a value is replaced by the environment
variable. Section keys are resolved as: Megatron's renamed fields (`layernorm_epsilon` -> `--norm-epsilon`,
`activation_func: swiglu` -> `--swiglu` ...), then a flag's dest, then a TransformerConfig field (copied
into the config as Megatron's yaml path does). YAML values win over the command line (Megatron ignores
the command line entirely with --yaml-cfg); anything else is one error line naming the key and the file.
"""
import os
import re

import yaml

from megatron.core.transformer.transformer_config import TransformerConfig

from .errors import ArgumentError
from .megatron_flags import record_use

_ENV = re.compile(r"\$\{([^}]*)\}")
_SECTIONS = ("language_model", "model_parallel")
_RENAMES = {"layernorm_epsilon": "norm_epsilon", "layernorm_zero_centered_gamma": "apply_layernorm_1p",
            "num_moe_experts": "num_experts"}
_ACTIVATIONS = {"swiglu": "swiglu", "squaredrelu": "squared_relu", "gelu": None}


class _Error(Exception):
    pass


class _EnvLoader(yaml.SafeLoader):
    """SafeLoader that expands ${VAR} in scalars (the value stays a string, as in Megatron)."""


def _expand(loader, node):
    value = loader.construct_scalar(node)
    for name in _ENV.findall(value):
        if name not in os.environ:
            raise _Error(f"environment variable {name} (in '{value}') is not set")
        value = value.replace("${" + name + "}", os.environ[name])
    return value


_EnvLoader.add_implicit_resolver("!env", re.compile(r".*\$\{[^}]*\}.*"), None)
_EnvLoader.add_constructor("!env", _expand)


def load_yaml_config(args, parser):
    """Set every key of ``args.yaml_cfg`` on ``args``; raise ArgumentError with one line on a bad key."""
    path = args.yaml_cfg
    if not os.path.isfile(path):
        raise ArgumentError(f"--yaml-cfg: file not found: {path}")
    try:
        with open(path) as f:
            config = yaml.load(f, Loader=_EnvLoader) or {}
        if not isinstance(config, dict):
            raise _Error("expected a mapping of keys to values at the top level")
        actions = {a.dest: a for a in parser._actions}
        for key, value in config.items():
            if key in _SECTIONS:
                if not isinstance(value, dict):
                    raise _Error(f"section '{key}' must be a mapping")
                for sub in sorted(value, key=lambda k: k != "activation_func"):  # gated_linear_unit reads it
                    _set_section_key(args, actions, f"{key}.{sub}", sub, value[sub], path)
            elif key in actions:
                _set(args, actions[key], key, value, path)
            else:
                raise _Error(f"unknown key '{key}' (top-level keys are Megatron argument names, e.g. micro_batch_size)")
    except _Error as e:
        raise ArgumentError(f"--yaml-cfg {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ArgumentError(f"--yaml-cfg {path}: not valid YAML: {' '.join(str(e).split())}") from None
    args.yaml_cfg = path


def _set_section_key(args, actions, name, key, value, path):
    if key == "activation_func":
        if value not in _ACTIVATIONS:
            raise _Error(f"{name}: '{value}' is not one of swiglu, squaredrelu, gelu")
        for flag in ("swiglu", "squared_relu"):
            _set(args, actions[flag], name, _ACTIVATIONS[value] == flag, path)
    elif key == "gated_linear_unit":
        if value and not args.swiglu:
            raise _Error(f"{name}: a gated linear unit needs activation_func: swiglu")
    elif key == "init_method":
        if value not in (None, "xavier_uniform"):
            raise _Error(f"{name}: '{value}' is not null or xavier_uniform")
        _set(args, actions["init_method_xavier_uniform"], name, value == "xavier_uniform", path)
    elif key == "persist_layer_norm":
        _set(args, actions["no_persist_layer_norm"], name, not value, path)
    elif _RENAMES.get(key, key) in actions:
        _set(args, actions[_RENAMES.get(key, key)], name, value, path)
    elif key in TransformerConfig.__dataclass_fields__:
        setattr(args, key, value)  # core_transformer_config_from_args copies same-named fields
    else:
        raise _Error(f"unknown key '{name}' (not a TransformerConfig field or Megatron argument)")


def _set(args, action, name, value, path):
    """Coerce ``value`` as the command line would, then set it (and note a registered Megatron flag)."""
    if value is not None:
        value = _coerce(action, name, value)
    if int(os.getenv("RANK", "0")) == 0 and getattr(args, action.dest, None) not in (value, action.default):
        print(f"--yaml-cfg {path}: {name} = {value!r} replaces the command-line value "
              f"{getattr(args, action.dest)!r}", flush=True)
    setattr(args, action.dest, value)
    if hasattr(action, "megatron_status"):
        record_use(args, action, f"{action.option_strings[0]} ({name} in {path})")


def _coerce(action, name, value):
    if action.nargs == 0:  # store_true / store_false: YAML booleans (or true/false from ${VAR})
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise _Error(f"{name}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value.split() if isinstance(value, str) else list(value) if isinstance(value, list) else [value]
        return [_one(action, name, v) for v in items]
    return _one(action, name, value)


def _one(action, name, value):
    kind, number = action.type, isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        if kind is not None and isinstance(value, str):
            value = kind(value)
        elif kind is float and number:
            value = float(value)
        elif kind is int and not (number and value == int(value)):
            raise ValueError
        elif kind is int:
            value = int(value)
    except (TypeError, ValueError):
        raise _Error(f"{name}: {value!r} is not a valid {action.type.__name__}") from None
    if action.choices is not None and value not in action.choices:
        raise _Error(f"{name}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value
