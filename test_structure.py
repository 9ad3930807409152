"""Tests of the project's shape, read from its source with ast: imports point down (no cycle,
and train_tiny.py, the entry point, imported by no module), and no module patches another at
run time (an assignment to an attribute of an imported module)."""

import ast
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MODULES = sorted(p for p in HERE.glob("*.py") if not p.name.startswith("test_") and p.name != "conftest.py")


def local_imports(path):
    """The project's modules that `path` imports, anywhere in the file (top level or inside a
    function), as module names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        found |= {n.split(".")[0] for n in names if (HERE / f"{n.split('.')[0]}.py").exists()}
    return found


def test_the_project_has_modules_to_check():
    assert {"train_tiny.py", "runner.py", "headline.py", "ablations.py", "moe.py"} <= {p.name for p in MODULES}


def find_cycle(graph):
    """A cycle of the directed graph {node: {successors}} as a list of nodes, or None (depth-first)."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = "done"
        stack.pop()
        return None
    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_imports_form_no_cycle_and_no_module_imports_the_entry_point():
    graph = {p.stem: local_imports(p) - {p.stem} for p in MODULES}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    importers = sorted(name for name, deps in graph.items() if "train_tiny" in deps)
    assert not importers, f"train_tiny.py is the entry point, but {importers} import it"


def root_name(node):
    """The name an attribute chain starts from (`multiprocessing` of multiprocessing.util), or None."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def module_patches(path):
    """`module.name = ...` (or +=, or setattr(module, ...)) where `module` is a module this file
    imports: (line, text) of each."""
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(t, ast.Attribute) and root_name(t.value) in modules:
                found.append((node.lineno, ast.unparse(t)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in modules:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_module_assigns_to_another_modules_attribute(path):
    assert module_patches(path) == []


def test_the_patch_check_sees_each_form_of_patch(tmp_path):
    f = tmp_path / "patcher.py"
    f.write_text("import moe\nimport multiprocessing.util as mu\nimport os, multiprocessing.util\n"
                 "moe.attend = None\nmu.spawnv_passfds = print\nos.x, y = 1, 2\nsetattr(moe, 'k', 1)\n"
                 "multiprocessing.util.spawnv_passfds = print\nclass A: pass\na = A()\na.attend = 1\na.b.c = 2\n")
    assert [line for line, _ in module_patches(f)] == [4, 5, 6, 7, 8]


LAB = ("train_tiny", "runner", "trainer", "headline", "ablations", "tasks", "report", "figures", "inside", "checks")


def all_imports(path):
    """Every module name `path` imports (the first part of each dotted name), the standard library's too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_the_process_machinery_sits_behind_train_tiny_alone():
    """runner.py (the command line, torchrun, --jobs processes, resume, Ctrl-C) is imported by
    train_tiny.py alone: no method, protocol or the trainer reaches it, and the trainer imports no
    process machinery of its own (its ranks come from torch.distributed)."""
    graph = {p.stem: local_imports(p) - {p.stem} for p in MODULES}
    assert sorted(name for name, deps in graph.items() if "runner" in deps) == ["train_tiny"]
    assert not all_imports(HERE / "trainer.py") & {"runner", "multiprocessing", "signal", "threading", "queue"}


def test_no_file_of_the_lab_is_over_450_lines():
    """The experiment's files around the methods (LAB): none over 450 non-blank lines."""
    sizes = {name: sum(1 for line in (HERE / f"{name}.py").read_text().splitlines() if line.strip()) for name in LAB}
    assert max(sizes.values()) <= 450, sizes
