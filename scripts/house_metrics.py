"""The shape of the package: the figures the layout is judged by.

Prints, for ``pytest_npu_parity/`` (or the folder given): lines of the largest module and class,
functions over 80 lines, functions with 10 or more parameters (``self``/``cls`` not counted;
``*args``/``**kwargs`` count one each), imports inside functions, and README.md's lines.

    python scripts/house_metrics.py [PACKAGE_DIR] [--json]
"""
from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path


def _length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    if names and names[0].arg in ("self", "cls"):
        count -= 1
    return count


def measure(package: Path) -> dict:
    """Figures of every ``*.py`` under ``package``: see the module docstring."""
    modules, classes, long_fns, many_params, local_imports = [], [], [], [], 0
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        rel = str(path.relative_to(package.parent))
        modules.append((len(text.splitlines()), rel))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((_length(node), f"{rel}::{node.name}"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _length(node) > 80:
                    long_fns.append((_length(node), f"{rel}::{node.name}"))
                if _params(node) >= 10:
                    many_params.append((_params(node), f"{rel}::{node.name}"))
                local_imports += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node)
                                     if n is not node and not isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    readme = package.parent / "README.md"
    return {
        "modules": len(modules), "lines": sum(n for n, _ in modules),
        "largest_module": max(modules), "largest_class": max(classes),
        "functions_over_80_lines": sorted(long_fns, reverse=True),
        "functions_with_10_or_more_params": sorted(many_params, reverse=True),
        "function_local_imports": local_imports,
        "readme_lines": len(readme.read_text(encoding="utf-8").splitlines()) if readme.is_file() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default=str(Path(__file__).resolve().parents[1] / "pytest_npu_parity"))
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = measure(Path(args.package).resolve())
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"modules {figures['modules']}, lines {figures['lines']}")
    print(f"largest module {figures['largest_module'][0]} ({figures['largest_module'][1]})")
    print(f"largest class {figures['largest_class'][0]} ({figures['largest_class'][1]})")
    print(f"functions over 80 lines: {len(figures['functions_over_80_lines'])}")
    print(f"functions with >= 10 parameters: {len(figures['functions_with_10_or_more_params'])}")
    print(f"function-local imports: {figures['function_local_imports']}")
    print(f"README lines: {figures['readme_lines']}")


if __name__ == "__main__":
    main()
