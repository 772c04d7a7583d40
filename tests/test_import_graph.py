"""No import circles in the project, module-level and function-level imports alike
(tools/import_graph.py), and the planes' import rule (docs/design.md, "Layout and the import rule")."""

from pathlib import Path

from tools.import_graph import circles, graph

ROOT = Path(__file__).resolve().parents[1]


def test_no_import_circles():
    g = graph(ROOT)
    assert len(g) > 50  # the walk found the project
    assert circles(g) == []


def test_the_planes_import_rule():
    g = graph(ROOT)

    def reaches(src: str, dst: str) -> list[str]:
        return sorted(f"{m} -> {t}" for m in g if m.startswith(src) for t in g[m] if t.startswith(dst))

    assert reaches("components.protocol", "components.engine") == []
    assert reaches("components.protocol", "components.control") == []
    assert reaches("components.control", "components.engine") == []
    assert reaches("components.planner", "components.engine") == []
    assert reaches("components.engine", "components.control") == []
    assert reaches("components.engine", "components.planner") == []
    assert reaches("components.engine", "components.worker") == []


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / "components"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from components.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from components import a\n")
    assert circles(graph(tmp_path)) == [["components.a", "components.b"]]
