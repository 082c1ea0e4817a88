"""The layering rule of the package, enforced: imports point down (entry -> training -> core), nothing
imports a ``_compat`` room, no import cycles (imports inside functions count), and an import inside a
function carries a ``# lazy:`` reason. ``tools/import_graph.py`` prints the same report for a person."""
import textwrap
from pathlib import Path

from tools.import_graph import build

ROOT = Path(__file__).resolve().parents[2]
GRAPH = build(ROOT)


def test_no_import_cycles():
    cycles = GRAPH.cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_point_down_and_compat_is_imported_by_none():
    assert GRAPH.layering_violations() == []


def test_core_utils_is_a_leaf():
    assert GRAPH.edges["megatron.core.utils"] == set()


def test_in_function_imports_are_rare_and_each_says_why():
    unexplained = [f"{i.module}:{i.line}: {i.text.strip()}" for i in GRAPH.in_function if not i.has_reason]
    assert not unexplained, "imports inside functions without a '# lazy: <reason>' comment:\n" + "\n".join(
        unexplained)
    assert 1000 * len(GRAPH.in_function) / GRAPH.lines < 2.0


def _write(root: Path, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_detector_sees_cycles_through_function_bodies_and_compat_imports(tmp_path):
    _write(tmp_path, {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": "",
        "megatron/core/a.py": "from megatron.core import b\n",
        "megatron/core/b.py": "def f():\n    from megatron.core.a import g\n",
        "megatron/core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron.core import a\n",
        "megatron/core/_compat/__init__.py": "",
        "megatron/core/_compat/a.py": "from megatron.core import a\n",
        "megatron/core/d.py": "from megatron.core._compat import a\nfrom megatron.training import t\n",
        "megatron/training/__init__.py": "",
        "megatron/training/t.py": "import os\n",
    })
    graph = build(tmp_path)
    assert graph.cycles() == [["megatron.core.a", "megatron.core.b"]]
    assert len(graph.in_function) == 1 and not graph.in_function[0].has_reason
    assert graph.edges["megatron.core.c"] == set()  # TYPE_CHECKING imports never run
    assert graph.layering_violations() == [
        "megatron.core.d imports megatron.core._compat.a (working code must not import a _compat room)",
        "megatron.core.d imports megatron.training.t (core must not import training)",
    ]
