"""The pure core imports nothing from the shell and touches no global RNG (checked on the source)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
GLOBAL_RNG = {
    ("torch", "manual_seed"), ("torch", "seed"), ("torch", "rand"), ("torch", "randn"), ("torch", "randint"),
    ("torch", "randperm"), ("torch", "multinomial"), ("torch", "bernoulli"), ("torch", "normal"),
    ("random", None), ("np", "random"), ("numpy", "random"),
}


def _core_files():
    for pkg in ("miles_fn", "ops"):
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_core_never_imports_launch():
    for path in _core_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for n in names:
                assert not (n == "launch" or n.startswith("launch.")), f"{path} imports {n}"


def test_core_calls_no_global_rng():
    for path in _core_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name != "random" for a in node.names), f"{path} imports random"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                pair = (node.value.id, node.attr)
                assert pair not in GLOBAL_RNG and (node.value.id, None) not in GLOBAL_RNG, (
                    f"{path}:{node.lineno} uses {node.value.id}.{node.attr}"
                )
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr.endswith("_") and node.func.attr[:-1] in {"normal", "uniform", "bernoulli",
                                                                            "random", "exponential"}:
                    raise AssertionError(f"{path}:{node.lineno} calls in-place RNG {node.func.attr}")


def test_core_has_no_module_level_mutable_state():
    for path in _core_files():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(getattr(node, "value", None),
                                                                              (ast.List, ast.Dict, ast.Set)):
                raise AssertionError(f"{path}:{node.lineno} defines module-level mutable state")
