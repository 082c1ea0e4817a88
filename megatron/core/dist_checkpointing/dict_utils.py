"""Walk nested state dicts (dicts and lists) and split them into sharded and common parts."""
from typing import Any, Callable, List, Tuple

import torch

from .mapping import ShardedObject, ShardedTensor

Path = Tuple[Any, ...]


def is_sharded(x) -> bool:
    return isinstance(x, (ShardedTensor, ShardedObject))


def iter_leaves(tree, path: Path = ()):
    """Yield ``(path, leaf)`` for every non-container value of a nested dict/list."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_leaves(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, path + (i,))
    else:
        yield path, tree


def split_common(tree) -> Tuple[Any, List[Tuple[Path, Any]]]:
    """Return ``(common, sharded)``: ``common`` is ``tree`` without sharded leaves (dicts/lists keep their
    structure, sharded leaves become None in lists and are dropped from dicts); ``sharded`` lists
    ``(path, leaf)`` for every ShardedTensor/ShardedObject."""
    sharded = [(p, v) for p, v in iter_leaves(tree) if is_sharded(v)]
    return _strip(tree), sharded


def _strip(tree):
    if isinstance(tree, dict):
        return {k: _strip(v) for k, v in tree.items() if not is_sharded(v)}
    if isinstance(tree, list):
        return [None if is_sharded(v) else _strip(v) for v in tree]
    return tree


def set_path(tree, path: Path, value) -> None:
    """Set ``tree[path[0]][path[1]]... = value``, creating dicts on the way."""
    for k in path[:-1]:
        if isinstance(tree, dict):
            tree = tree.setdefault(k, {})
        else:
            tree = tree[k]
    if isinstance(tree, list):
        while len(tree) <= path[-1]:
            tree.append(None)
    tree[path[-1]] = value


def map_leaves(fn: Callable, tree):
    """Return a copy of ``tree`` with ``fn`` applied to each leaf."""
    if isinstance(tree, dict):
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(fn, v) for v in tree]
    return fn(tree)


def _is_shell(tree) -> bool:
    """A dict holding only (nested) empty dicts: what stripping sharded leaves leaves behind."""
    return isinstance(tree, dict) and all(_is_shell(v) for v in tree.values())


def prune_shells(common, request) -> None:
    """Drop from ``common`` the empty containers of sharded state that ``request`` does not ask for.

    The common state is rank 0's state at save time with sharded leaves removed; the dicts that held
    them (e.g. optimizer state per parameter of rank 0's layers) depend on the saving layout and must
    not appear in another rank's or another layout's loaded state.
    """
    if not isinstance(common, dict):
        return
    for k in list(common):
        v = common[k]
        if not isinstance(v, dict):
            continue
        if isinstance(request, dict) and isinstance(request.get(k), dict):
            prune_shells(v, request[k])
        elif _is_shell(v) and not (isinstance(request, dict) and k in request):
            del common[k]


# ---- Megatron's generic nested dict/list helpers ------------------------------------------------

def _container(x):
    return isinstance(x, (dict, list))


def extract_matching_values(x, predicate: Callable, return_lists_as_dicts: bool = False):
    """(matching, non-matching): two copies of the nesting of `x` split by `predicate(leaf)`.
    Lists become {index: value} dicts with `return_lists_as_dicts` (so they can be re-merged)."""
    if not _container(x):
        raise ValueError(f"extract_matching_values: expected a dict or list, got {type(x)}")
    as_dict = isinstance(x, dict) or return_lists_as_dicts
    match, rest = ({}, {}) if as_dict else ([], [])

    def put(target, key, value):
        if as_dict:
            target[key] = value
        else:
            target.append(value)
    for key, value in (x.items() if isinstance(x, dict) else enumerate(x)):
        if _container(value) and (value or isinstance(x, dict)):
            m, r = extract_matching_values(value, predicate, return_lists_as_dicts) if value else ({}, value)
            if m:
                put(match, key, m)
            if r or not value:
                put(rest, key, r)
        else:
            put(match if predicate(value) else rest, key, value)
    return match, rest


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
    if _container(x):
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
        if _container(value):
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


def dict_list_map_inplace(f: Callable, x):
    """Map the leaves of nested dicts/lists in place; a bare leaf returns f(leaf)."""
    if isinstance(x, dict):
        for key in x:
            x[key] = dict_list_map_inplace(f, x[key])
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
        return x
    return f(x)


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
