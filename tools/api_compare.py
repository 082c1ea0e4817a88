"""Our side of tools/api_report.py: import our modules, inspect each name Megatron exports, compare."""
import dataclasses
import enum
import importlib
import inspect
import math
import sys

import torch

from tools.api_reasons import reason_for

KINDS = {inspect.Parameter.POSITIONAL_ONLY: "positional", inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos_or_kw",
         inspect.Parameter.VAR_POSITIONAL: "var_positional", inspect.Parameter.KEYWORD_ONLY: "kw_only",
         inspect.Parameter.VAR_KEYWORD: "var_keyword"}
_MISSING = object()
_UNKNOWN = object()


def _namespace(obj):
    """Globals in which Megatron's default expressions are evaluated: the module that defines ours."""
    ns = {"torch": torch, "F": torch.nn.functional, "math": math}
    mod = sys.modules.get(getattr(obj, "__module__", "") or "")
    ns.update(vars(mod) if mod else {})
    return ns


def _evaluate(src, ns):
    if src is None:
        return _MISSING
    if src.startswith("lambda"):
        return _UNKNOWN  # two lambdas never compare equal; the parameter and its presence are checked
    factory = src.startswith("factory:")
    try:
        value = eval(src[len("factory:"):] if factory else src, ns)  # Megatron's default expression
        return value() if factory else value
    except Exception:
        return _UNKNOWN


def _same_default(theirs, ours):
    if theirs is _UNKNOWN:
        return True  # an expression naming Megatron-only objects; the name is checked, not the value
    try:
        return theirs is ours or bool(theirs == ours) and type(theirs) is type(ours) or (
            isinstance(theirs, (int, float)) and not isinstance(theirs, bool) and theirs == ours)
    except Exception:
        return False


def _show(src):
    return "required" if src is None else src.replace("factory:", "")


def compare_params(theirs, ours, ns):
    """Differences between Megatron's [name, kind, default] list and ours; extras of ours as notes."""
    diffs, notes = [], []
    by_name = {p[0]: p for p in ours}
    pos = lambda ps: [p[0] for p in ps if p[1] in ("positional", "pos_or_kw")]  # noqa: E731
    var_kw = any(p[1] == "var_keyword" for p in ours)
    their_pos, our_pos = pos(theirs), pos(ours)
    if our_pos[:len(their_pos)] != their_pos and all(n in by_name for n in their_pos):
        diffs.append(f"positional order ({', '.join(our_pos)}) vs Megatron ({', '.join(their_pos)})")
    for name, kind, default in theirs:
        mine = by_name.get(name)
        if kind in ("var_positional", "var_keyword"):
            if not any(p[1] == kind for p in ours):
                diffs.append(f"no {'*' if kind == 'var_positional' else '**'}{name}")
            continue
        if mine is None:  # even if ours takes **kwargs: it may refuse or drop the name
            diffs.append(f"missing `{name}`" + (" (ours takes **kwargs)" if var_kw else ""))
            continue
        if default is not None:
            value = _evaluate(default, ns)
            if mine[2] is _MISSING:
                diffs.append(f"`{name}` required (Megatron default {_show(default)})")
            elif not _same_default(value, mine[2]):
                diffs.append(f"`{name}` default {_repr(mine[2])} (Megatron {_show(default)})")
    names = {p[0] for p in theirs}
    for name, kind, default in ours:
        if name in names or kind in ("var_positional", "var_keyword"):
            continue
        (diffs if default is _MISSING else notes).append(
            f"{'extra required' if default is _MISSING else 'extra'} `{name}`")
    return diffs, notes


def _repr(value):
    text = getattr(value, "__name__", None) or repr(value)
    return text if len(text) < 40 else text[:37] + "..."


def our_params(obj):
    """[name, kind, default] of a callable (a class: its constructor), defaults as values."""
    sig = inspect.signature(obj)
    return [[p.name, KINDS[p.kind], _MISSING if p.default is inspect.Parameter.empty else p.default]
            for p in sig.parameters.values()]


def compare_name(entry, obj, data):
    kind = entry["kind"]
    if kind == "alias":
        target = entry["target"]
        mod, name = target.rsplit(".", 1)
        resolved = data["modules"].get(mod, {}) or {}
        if target in data["modules"] or (name not in resolved and inspect.ismodule(obj)):
            return ("same", [], ["module"]) if inspect.ismodule(obj) else ("differs", ["not a module"], [])
        if name in resolved:
            return compare_name(resolved[name], obj, data)
        return "same", [], [f"re-export of {target}"]
    ns = _namespace(obj)
    if kind == "enum":
        if not (inspect.isclass(obj) and issubclass(obj, enum.Enum)):
            return "differs", ["not an Enum"], []
        missing = [m for m in entry["members"] if m not in obj.__members__]
        return ("differs" if missing else "same"), ([f"missing members {missing}"] if missing else []), []
    if kind == "dataclass":
        if not dataclasses.is_dataclass(obj):
            return "differs", ["not a dataclass"], []
        ours = [[f.name, "pos_or_kw", f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else _MISSING)]
            for f in dataclasses.fields(obj) if f.init]
        theirs = [[n, "kw_only", d] for n, d in entry["fields"].items()]  # fields compared by keyword
        diffs, notes = compare_params(theirs, ours, ns)
        return ("differs" if diffs else "same"), diffs, notes
    if entry.get("params") is None:  # class without a constructor of its own in Megatron
        return ("same", [], []) if inspect.isclass(obj) else ("differs", ["not a class"], [])
    if kind == "class" and not inspect.isclass(obj):
        return "differs", ["not a class"], []
    try:
        ours = our_params(obj)
    except (TypeError, ValueError):
        return "differs", ["signature not inspectable"], []
    diffs, notes = compare_params(entry["params"], ours, ns)
    return ("differs" if diffs else "same"), diffs, notes


def compare_all(data):
    """{module: [(name, status, diffs, notes_or_reason)]} over every name in the json."""
    results = {}
    for mod, names in data["modules"].items():
        rows = []
        try:
            module = importlib.import_module(mod)
        except ImportError:
            module = None
        for name in sorted(names):
            obj = getattr(module, name, None) if module is not None else None
            if obj is None:
                rows.append((name, "absent", [], [reason_for(mod, name)]))
            else:
                status, diffs, notes = compare_name(names[name], obj, data)
                if status == "differs":
                    notes = notes + [reason_for(mod, name)]
                rows.append((name, status, diffs, notes))
        results[mod] = rows
    return results


def summary(results):
    rows = [r for rs in results.values() for r in rs]
    count = {s: sum(r[1] == s for r in rows) for s in ("same", "differs", "absent")}
    return count, len(rows)


def render_md(results):
    count, total = summary(results)
    pct = 100.0 * count["same"] / max(total, 1)
    out = ["# Megatron Core 0.19.2 API coverage", "",
           "Generated by `python tools/api_report.py` from `docs/api_megatron_0.19.2.json` (Megatron's names",
           "and signatures read from its wheel with `ast`) and our modules (imported and inspected).",
           "`tests/unit/compat/test_api_report.py` fails when this page is stale.", "",
           "Unit: each public module-level name of the listed modules. **same**: every call Megatron accepts",
           "is accepted with the same defaults (a class: its constructor; a dataclass: its fields by keyword;",
           "an enum: its members; extra optional parameters of ours are listed); **differs**: the differences",
           "and why; **absent**: why.", "",
           "Config dataclasses (`TransformerConfig`, `ModelParallelConfig`, `OptimizerConfig`,",
           "`DistributedDataParallelConfig`, `GPTDatasetConfig`) accept every Megatron field. Fields without a",
           "feature here live in `_compat_fields.py` mixins at Megatron's defaults: any other value is refused",
           "with one line naming the field, except where Megatron itself ignores the field (`moe_*` without",
           "experts, `mtp_*` without MTP layers). A class that defines such a field itself takes it over.",
           "The `*_with_transformer_engine_*` spec functions return our fastest (local) spec.",
           "Megatron's typing Protocols (`*Builder` / `*Interface`) are types only, as there. Present but",
           "refusing at use: `StragglerDetector` exists in its default disabled state (Megatron's",
           "`pretrain_gpt.py` creates one at import) and refuses `configure(enabled=True)`; enum members",
           "without a feature (`AttnMaskType.causal_bottom_right`, `Fp8Recipe.custom`, CUDA-graph scopes)",
           "are refused by the module or config field that would use them.", "",
           f"**{count['same']} of {total} names ({pct:.1f}%) present with Megatron's signature**; "
           f"{count['differs']} present with differences, {count['absent']} absent.", "",
           "| module | same | differs | absent |", "|---|---|---|---|"]
    for mod, rows in results.items():
        c = {s: sum(r[1] == s for r in rows) for s in ("same", "differs", "absent")}
        out.append(f"| `{mod}` | {c['same']} | {c['differs']} | {c['absent']} |")
    for mod, rows in results.items():
        out += ["", f"## `{mod}`", ""]
        if not rows:
            out.append("(no public names)")
            continue
        out += ["| name | status | details |", "|---|---|---|"]
        for name, status, diffs, notes in rows:
            details = "; ".join(diffs + notes).replace("|", "\\|")
            out.append(f"| `{name}` | {status} | {details} |")
    return "\n".join(out) + "\n"
