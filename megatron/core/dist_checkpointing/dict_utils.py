"""Walk nested state dicts (dicts and lists): leaves by path, in-place maps, predicate splits.

These helpers know nothing of sharded types, so ``mapping`` (the types) can build on them; the split of
a state dict into its sharded and common parts lives with its user, ``serialization``. Megatron's other
generic nested helpers (``diff``, ``merge``, ``nested_values`` ...) live in ``megatron.core._compat``.
"""
from typing import Any, Callable, Tuple

from megatron.core.utils import lazy_names

Path = Tuple[Any, ...]

# Megatron's generic nested helpers that this project does not call, resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core._compat.dict_utils" for name in (
    "diff", "inspect_types", "nested_items_iter", "nested_values", "dict_map", "dict_map_with_key",
    "dict_list_map_outplace", "merge", "map_reduce")})


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
    """A dict holding only (nested) empty dicts, or a non-empty list of only None (a factory's list of
    ShardedTensors): what stripping sharded leaves leaves behind."""
    if isinstance(tree, list):
        return bool(tree) and all(v is None for v in tree)
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
        if not isinstance(v, (dict, list)):
            continue
        if isinstance(request, dict) and isinstance(request.get(k), dict):
            prune_shells(v, request[k])
        elif _is_shell(v) and not (isinstance(request, dict) and k in request):
            del common[k]


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
