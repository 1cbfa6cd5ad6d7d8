"""The house rules of the source tree, checked: what imports what, no import cycle, no long file.

    common/          settings, logs, telemetry, keys, the prefix block hash: imports none of ours
    protocol/        messages, codec, transport: imports only common/
    gateway/         HTTP; never imports the worker (nor torch)
    engine_worker/   the engine; never imports the gateway
    kestrel/         the launcher: the only package that imports both
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "protocol", "gateway", "engine_worker", "kestrel", "loadgen")
SOURCE_DIRS = (*PACKAGES, "benchmarks", "deploy")
MAX_LINES = 500  # a smoke alarm: a file is one noun, split by meaning (DESIGN.md)
# package -> the packages of ours it may import
ALLOWED = {
    "common": set(),
    "protocol": {"common"},
    "gateway": {"common", "protocol"},
    "engine_worker": {"common", "protocol"},
    "kestrel": {"common", "protocol", "gateway", "engine_worker", "loadgen"},
    "loadgen": {"common", "protocol"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module, here: str, everywhere: bool) -> Iterator[str]:
    """Names imported by a module: at module level only (what runs on import), or anywhere."""
    nodes = ast.walk(tree) if everywhere else _top_level(tree.body)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here.split(".")[:-node.level] + ([base] if base else []))
            yield from (f"{base}.{a.name}" for a in node.names)
            yield base


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    for node in body:
        if _is_type_checking(node):
            continue
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            yield from _top_level(node.body + node.orelse + getattr(node, "handlers", []))
        elif isinstance(node, ast.ExceptHandler):
            yield from _top_level(node.body)


def _graph(everywhere: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for imported in _imports(ast.parse(path.read_text()), name, everywhere):
            while imported and imported not in mods:  # `from a.b import func` -> a.b
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def test_no_import_cycle() -> None:
    """Counting imports inside functions too: a lazy import hides a cycle, it does not end it."""
    graph = _graph(everywhere=True)
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_what_the_layout_allows(package: str) -> None:
    bad = sorted(f"{src} imports {dst}" for src, dsts in _graph(everywhere=True).items()
                 if src.split(".")[0] == package for dst in dsts
                 if dst.split(".")[0] not in ALLOWED[package] | {package})
    assert not bad, bad


def test_the_gateway_side_never_imports_torch() -> None:
    mods = _modules()
    bad = [name for name, path in mods.items()
           if name.split(".")[0] in ("common", "protocol", "gateway", "kestrel")
           for imported in _imports(ast.parse(path.read_text()), name, everywhere=True)
           if imported.split(".")[0] == "torch"]
    assert not bad, bad


def test_no_source_file_is_over_the_line_limit() -> None:
    """Python and the kernels' C++ (engine_worker/csrc/*.cpp, *.h) alike."""
    files = [p for d in SOURCE_DIRS for pattern in ("*.py", "*.cpp", "*.h")
             for p in (ROOT / d).rglob(pattern)]
    long = sorted(f"{p.relative_to(ROOT)}: {n}" for p in files
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert not long, long


def _architecture_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Architecture")
    return text[start:text.index("\n## ", start + 1)]


def test_the_readme_architecture_names_every_package_and_only_files_that_exist() -> None:
    """The README's architecture section and the package layout say the same thing: every
    package is described, and every file or folder it names exists in one of them."""
    section = _architecture_section()
    for package in PACKAGES:
        assert f"`{package}/`" in section, package
    named = {p.rstrip("/") for p in section.split("`")[1::2]
             if p.endswith((".py", "/")) and " " not in p}
    sources = [p.relative_to(ROOT) for d in SOURCE_DIRS for p in (ROOT / d).rglob("*")]
    missing = sorted(n for n in named if not any(src.match(n) for src in sources)
                     and not (ROOT / n).exists())
    assert len(named) > 20 and not missing, missing


def test_the_front_pages_open_with_their_figures() -> None:
    """Issue 38: the README's headline figures sit in its first 40 lines and point at the
    report, whose first section is its current figures."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:40]
    assert any("INFERENCE_BENCHMARK_REPORT.md#current-figures" in line for line in readme)
    assert sum("llama-server" in line for line in readme) >= 2
    report = (ROOT / "INFERENCE_BENCHMARK_REPORT.md").read_text(encoding="utf-8")
    sections = [line for line in report.splitlines() if line.startswith("## ")]
    assert sections[0] == "## Current figures", sections[:3]


MAX_FILES = 20  # issue 38: a folder a reader takes in at once


def test_no_gateway_folder_holds_more_than_twenty_modules_and_tests_mirror_them() -> None:
    """The gateway is grouped by responsibility (issue 38): no folder of it over MAX_FILES
    modules, and tests/gateway/ has a folder for each of its subpackages and no other."""
    gateway = ROOT / "gateway"
    folders = [gateway, *(p for p in gateway.iterdir() if (p / "__init__.py").exists())]
    for folder in folders:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= MAX_FILES, (folder, len(modules))
    subpackages = {p.name for p in folders[1:]}
    mirrored = {p.name for p in (ROOT / "tests" / "gateway").iterdir()
                if p.is_dir() and p.name != "__pycache__"}
    assert len(subpackages) >= 4 and mirrored == subpackages, (subpackages, mirrored)


def test_engine_worker_tests_mirror_its_subpackages() -> None:
    """tests/engine_worker/ has a folder for each subpackage of engine_worker/ and no other
    (issue 55), and a test named after a module of a subpackage (test_<module>.py, where
    engine_worker/<sub>/<module>.py exists and engine_worker/<module>.py does not) is in that
    subpackage's folder."""
    package, tests = ROOT / "engine_worker", ROOT / "tests" / "engine_worker"
    subpackages = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    mirrored = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert len(subpackages) >= 2 and mirrored == subpackages, (subpackages, mirrored)
    home = {p.stem: sub for sub in subpackages for p in (package / sub).glob("*.py")
            if p.name != "__init__.py" and not (package / p.name).exists()}
    misplaced = sorted(str(t.relative_to(ROOT)) for t in tests.rglob("test_*.py")
                       if t.stem.removeprefix("test_") in home
                       and t.parent != tests / home[t.stem.removeprefix("test_")])
    assert not misplaced, misplaced
