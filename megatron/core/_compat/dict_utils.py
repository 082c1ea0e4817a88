"""Megatron Core's generic nested dict/list helpers that this project's own code does not call.

Reached from ``megatron.core.dist_checkpointing.dict_utils`` through its lazy alias table.
"""
from typing import Callable, Tuple

import torch


def _is_container(x) -> bool:
    return isinstance(x, (dict, list))


def diff(x1, x2, prefix: Tuple = ()):
    """(only_left, only_right, mismatch) key paths between two nested structures; tensors compare
    element-wise, sharded objects by their data."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        mismatch = []
        for k in x1.keys() & x2.keys():
            sub = diff(x1[k], x2[k], prefix + (k,))
            left, right, mismatch = left + sub[0], right + sub[1], mismatch + sub[2]
        return left, right, mismatch
    if isinstance(x1, (list, tuple)):
        left = [prefix + (i,) for i in range(len(x2), len(x1))]
        right = [prefix + (i,) for i in range(len(x1), len(x2))]
        mismatch = []
        for i, (a, b) in enumerate(zip(x1, x2)):
            sub = diff(a, b, prefix + (i,))
            left, right, mismatch = left + sub[0], right + sub[1], mismatch + sub[2]
        return left, right, mismatch
    if hasattr(x1, "replica_id") and hasattr(x2, "replica_id"):
        return diff(x1.data, x2.data, prefix + (type(x1),))
    try:
        if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
            differs = x1.shape != x2.shape or not torch.equal(x1.cpu(), x2.cpu())
        else:
            differs = bool(x1 != x2)
    except (RuntimeError, TypeError, ValueError):
        differs = True
    return [], [], [(prefix, type(x1), type(x2))] if differs else []

def inspect_types(x, prefix: Tuple = (), indent: int = 4):
    """Print the nesting of `x` with the type (tensor: shape) of each leaf."""
    pad = " " * indent * len(prefix)
    if _is_container(x):
        print()
        for key, value in (x.items() if isinstance(x, dict) else enumerate(x)):
            print(f"{pad}{'>' if isinstance(x, dict) else '-'} {key}: ", end="")
            inspect_types(value, prefix + (key,), indent)
    elif isinstance(x, torch.Tensor):
        print(f"Tensor of shape {x.shape}")
    else:
        text = str(x)
        print(f"[{type(x)}]: {text[:30] + '... (truncated)' if len(text) > 30 else text}")

def nested_items_iter(x):
    """(container, key, leaf) for every leaf of a nested dict/list."""
    for key, value in (x.items() if isinstance(x, dict) else enumerate(x)):
        if _is_container(value):
            yield from nested_items_iter(value)
        else:
            yield x, key, value

def nested_values(x):
    """Every leaf of a nested dict/list."""
    return (value for _, _, value in nested_items_iter(x))

def dict_map(f: Callable, d: dict):
    """Replace every leaf v by f(v), in place."""
    for container, key, value in list(nested_items_iter(d)):
        container[key] = f(value)

def dict_map_with_key(f: Callable, d: dict):
    """Replace every leaf v under key k by f(k, v), in place."""
    for container, key, value in list(nested_items_iter(d)):
        container[key] = f(key, value)

def dict_list_map_outplace(f: Callable, x):
    """A new nested dict/list with f applied to every leaf."""
    if isinstance(x, dict):
        return {key: dict_list_map_outplace(f, v) for key, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)

def merge(x1, x2, key: Tuple = ()):
    """Merge x2 into x1 recursively (lists element-wise); two leaves at one path is an error."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v in x2.items():
            x1[k] = merge(x1[k], v, key + (k,)) if k in x1 else v
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"cannot merge lists of lengths {len(x1)} and {len(x2)} at {key}")
        x1[:] = [merge(a, b, key + (i,)) for i, (a, b) in enumerate(zip(x1, x2))]
        return x1
    raise ValueError(f"two values for one path {key}: {x1!r} and {x2!r}")

def map_reduce(xs, key_fn: Callable = lambda x: x, value_fn: Callable = lambda x: x,
               reduce_fn: Callable = lambda x: x) -> dict:
    """{key_fn(x): reduce_fn([value_fn(x) for x with that key])} (more_itertools.map_reduce)."""
    groups = {}
    for x in xs:
        groups.setdefault(key_fn(x), []).append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
