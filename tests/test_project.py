"""Checks on the project's own plumbing: the README's commands, CI, and package metadata."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Set-up")[1].split("\n## ")[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert "pytest" in tests and "pytest" not in main_job
    for command in commands:
        assert "\n" not in command.strip(), "each set-up command must be one line"
        # torch is installed with the CPU pin only where it is missing
        assert command.startswith('python -c "import torch" 2>/dev/null || pip install torch==2.13.0;')


# The one line .ci/run may add to the README's test command: Debian's chromium for the dashboard test
# (tests/test_monitor.py), installed only where apt-get and root are available; the README shows it too.
CHROMIUM_LINE = (
    'if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get install -y chromium chromium-driver iptables'
    " || { apt-get update && apt-get install -y chromium chromium-driver iptables; } || true; fi"
)


def test_ci_runs_the_readme_test_command_and_nothing_else() -> None:
    ci_lines = [
        line
        for line in ROOT.joinpath(".ci/run").read_text().splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))
    ]
    assert ci_lines in ([readme_commands()[1]], [CHROMIUM_LINE, readme_commands()[1]])
    if CHROMIUM_LINE in ci_lines:
        assert CHROMIUM_LINE in ROOT.joinpath("README.md").read_text(), "the README must show the chromium line"


def test_package_metadata_keeps_the_user_facing_torch_range() -> None:
    project = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["project"]
    assert "torch>=2.1" in project["dependencies"]
    assert project["requires-python"] == ">=3.10"
    assert "pytest-timeout" in " ".join(project["optional-dependencies"]["test"])


def _imported_top_modules(path: Path) -> set[str]:
    """Top-level names of every module that a file imports (absolute imports only)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def test_the_test_extra_installs_everything_the_tests_and_examples_import() -> None:
    """A fresh venv with `pip install -e ".[test]"` must run the whole suite (scikit-learn was missing once)."""
    import importlib.metadata
    import sys

    project = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["project"]
    declared = {_requirement_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    local = {p.stem for folder in ("tests", "examples", "benchmarks") for p in ROOT.joinpath(folder).glob("*.py")}
    local |= {"hivemind_ext", "tests", "examples", "benchmarks"}
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for path in [*ROOT.joinpath("tests").glob("*.py"), *ROOT.joinpath("examples").glob("*.py")]:
        for module in _imported_top_modules(path) - local - set(sys.stdlib_module_names):
            names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
            if not names & declared:
                missing.setdefault(module, []).append(path.name)
    assert not missing, f"imported by the tests or examples but not in the dependencies or the test extra: {missing}"


def _library_import_graph() -> dict[str, set[str]]:
    """module -> the hivemind_ext modules it imports, ``if TYPE_CHECKING:`` blocks and function bodies included
    (a cycle hidden behind a type-only or a deferred import is still two layers that depend on each other)."""
    import ast

    package_root = ROOT / "hivemind_ext"
    modules = {}
    for path in package_root.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path

    def resolve(base: str, level: int, module: str | None, is_package: bool) -> str:
        if level == 0:
            return module or ""
        anchor = base.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - (level - 1)]
        return ".".join([*anchor, module] if module else anchor)

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(name, node.level, node.module, path.name == "__init__.py")
                candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            targets.update(c for c in candidates if c in modules and c != name)
        graph[name] = targets
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    visiting, done = [], set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node) :], node]
        if node in done:
            return None
        visiting.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_library_has_no_import_cycles() -> None:
    """Layers depend downward only: no module of hivemind_ext imports (through others) itself.

    A package's ``__init__`` counts as a module that imports what it re-exports, so a submodule that
    imports its own package's ``__init__`` while that ``__init__`` imports it back is a cycle too."""
    graph = _library_import_graph()
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# private names a test may use, by module: torch's fused ops (torch._foreach_*) and sys._getframe
_PRIVATE_ALLOWED = {"torch": ("_foreach_",), "sys": ("_getframe",)}


def _private_accesses(source: str, filename: str = "<test>") -> list[str]:
    """Every ``obj._name`` in ``source`` (read, patched or called) except on ``self`` / ``cls`` and the
    allowed modules' names; dunder names (``obj.__class__``) are not private."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        if owner in ("self", "cls") or node.attr.startswith(_PRIVATE_ALLOWED.get(owner or "", ())):
            continue
        found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_access_finder_finds_one() -> None:
    planted = "group[0]._scratch\nmatchmaker._exchange = fake\naverager.state._donor.stats\n"
    assert len(_private_accesses(planted)) == 3
    allowed = "self._lock\ncls._instances\ntorch._foreach_add_(a, b)\nsys._getframe(1)\nx.__class__\n_helper(x)\n"
    assert _private_accesses(allowed) == []
    assert len(_private_accesses("torch._C\nsys._current_frames()\n")) == 2  # only the allowed names


def test_no_test_reads_or_patches_a_private_attribute() -> None:
    """Tests go through seams (a faulty-DHT wrapper, a round-driver hook, a constructor argument, a
    documented read-only property), never through a library object's private attributes, so that
    the library's insides can change without the tests (issue 9)."""
    found = [
        hit
        for path in sorted(ROOT.joinpath("tests").glob("*.py"))
        for hit in _private_accesses(path.read_text(), path.name)
    ]
    assert not found, "tests reach into private attributes:\n" + "\n".join(found)
