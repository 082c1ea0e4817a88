"""Walk nested state dicts (dicts and lists) and split them into sharded and common parts."""
from typing import Any, Callable, List, Tuple

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
