"""The plan written once, and true: the README's Layout section names every module of
`streaming/` (and nothing that is gone), the package's layers import only downwards, with no
import circle anywhere in it, and nothing in it imports the brief's top-level modules (lm.py is
the model layer's facade, not a module the package leans on)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streaming"
TOP_LEVEL = {"server", "lm", "decoding", "detokenizer", "client", "proxy", "experiments"}
# Each layer may import itself and the layers after it in this list (lower ones); the modules
# beside the layers (launch, qoe, http_client, ...) are not ranked.
LAYERS = ["server", "generation", "model", "wire"]


def layout_section():
    text = (ROOT / "README.md").read_text()
    return text[text.index("\n## Layout") :]


def named_in_layout():
    """Every `streaming/...` path the Layout section names (a cell may name several)."""
    return set(re.findall(r"`(streaming/[\w/]+\.py)`", layout_section()))


def modules():
    return {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def test_the_layout_names_every_module_and_only_modules_that_exist():
    named, present = named_in_layout(), modules()
    assert not present - named, f"modules missing from the README's Layout: {sorted(present - named)}"
    assert not named - present, f"the README's Layout names what is gone: {sorted(named - present)}"


def test_each_package_docstring_points_to_the_layout():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Layout" in doc or init.parent == PACKAGE, f"{init.relative_to(ROOT)} does not point to the Layout"


def imports():
    """{module: {imported streaming modules or top-level names}} from every import statement,
    at any depth (an import inside a function or under TYPE_CHECKING counts too)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = found
    return graph


def test_the_package_imports_none_of_the_top_level_modules():
    for module, names in imports().items():
        leaning = {n for n in names if n.split(".")[0] in TOP_LEVEL}
        assert not leaning, f"{module} imports {sorted(leaning)} from the top level"


def test_there_is_no_import_circle_in_the_package():
    graph = imports()
    edges = {m: {n for n in names if n in graph and n != m} for m, names in graph.items()}
    for m in edges:  # a package's face (its __init__) is not an edge to its own modules
        edges[m] = {n for n in edges[m] if not m.startswith(n + ".")}
    seen, on_path = set(), []

    def visit(m):
        if m in on_path:
            raise AssertionError("import circle: " + " -> ".join(on_path[on_path.index(m) :] + [m]))
        if m in seen:
            return
        on_path.append(m)
        for n in sorted(edges[m]):
            visit(n)
        on_path.pop()
        seen.add(m)

    for m in sorted(edges):
        visit(m)


def test_the_layers_import_only_downwards():
    for module, names in imports().items():
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in LAYERS:
            continue
        rank = LAYERS.index(parts[1])
        for n in names:
            q = n.split(".")
            if q[0] == "streaming" and len(q) > 1 and q[1] in LAYERS:
                assert LAYERS.index(q[1]) >= rank, f"{module} imports {n}: a higher layer"
