"""The repository keeps its promises to a newcomer: README commands as CI runs them, docs that resolve, indexed results."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [ROOT / "README.md", *DOCS, ROOT / "benchmarks" / "results" / "README.md",
            ROOT / "helm" / "omni-ray" / "README.md", ROOT / "load_tests" / "README.md"]
RESULTS = ROOT / "benchmarks" / "results"
# The number of a working run means nothing outside the team that ran it: none belongs in a tracked file.
RUN_NUMBER = re.compile(r"sessions?[ _-]*[0-9]", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"`((?:omni_ray|deployments|benchmarks|tests|helm|docs|load_tests)/[^`\s]*)`")


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [line for line in out.splitlines() if line]


def _code_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", markdown, re.MULTILINE | re.DOTALL)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_ci_runs_the_readme_quick_start_block() -> None:
    commands = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print"], capture_output=True, text=True,
                              check=True).stdout
    readme = (ROOT / "README.md").read_text()
    assert commands.strip() and commands.strip() in readme
    lines = [line for line in commands.splitlines() if line and not line.startswith("#")]
    assert any("pip install -c constraints.txt" in line for line in lines)  # the pinned versions the tests ran with
    assert any(line.startswith("omni-ray generate") for line in lines)  # the main job on the embedded default
    assert lines[-1] == "python -m pytest -q"
    assert "pip install" not in (ROOT / ".ci" / "run").read_text()  # nothing installed behind the README's back


def test_constraints_pin_versions_that_pyproject_admits() -> None:
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    for package in ("torch", "transformers", "ray", "triton"):
        assert package in pins, package
        assert re.search(rf'"{package}(\[[a-z]+\])?[=<>]', pyproject), f"pyproject.toml does not name {package}"


def test_readme_is_for_users_and_short() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for section in ("## Quick start", "## Serving", "## Performance", "## Documentation"):
        assert section in readme


def test_no_run_numbers_in_tracked_files() -> None:
    offenders = []
    for name in _tracked_files():
        if RUN_NUMBER.search(name):
            offenders.append(f"{name}: in its name")
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if RUN_NUMBER.search(line):
                offenders.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders[:40])


@pytest.mark.parametrize("markdown", MARKDOWN, ids=_rel)
def test_markdown_links_resolve(markdown: Path) -> None:
    missing = []
    for target in LINK.findall(markdown.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (markdown.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{_rel(markdown)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("markdown", MARKDOWN, ids=_rel)
def test_repository_paths_named_in_docs_exist(markdown: Path) -> None:
    missing = []
    for name in REPO_PATH.findall(markdown.read_text()):
        name = name.rstrip(".,:;)")
        if "<" in name:  # a placeholder such as omni_ray/models/<family>/
            continue
        alternatives = re.sub(r"\{([^}]*)\}", lambda m: m.group(1).split(",")[0], name)  # a.{py,cu} → a.py
        if not (any(ROOT.glob(alternatives)) if "*" in alternatives else (ROOT / alternatives).exists()):
            missing.append(name)
    assert not missing, f"{_rel(markdown)} names paths that do not exist: {missing}"


def test_results_index_lists_every_result() -> None:
    index = (RESULTS / "README.md").read_text()
    files = [path for path in RESULTS.rglob("*") if path.is_file() and path.name != "README.md"]
    assert files
    unlisted = [str(path.relative_to(RESULTS)) for path in files if str(path.relative_to(RESULTS)) not in index]
    assert not unlisted, f"benchmarks/results/README.md does not list: {unlisted}"


def test_results_are_named_by_benchmark_date_card_and_commit() -> None:
    name = re.compile(r"\d{4}-\d{2}-\d{2}_(cpu|[hab]\d+(x\d)?)_[0-9a-f]{7,12}(_[a-z0-9.-]+)?\.[a-z]+")
    for path in RESULTS.rglob("*"):
        if path.is_file() and path.name != "README.md":
            assert path.parent.parent == RESULTS, f"{path}: results sit in one folder per benchmark"
            assert name.fullmatch(path.name), f"{path.name}: expected DATE_CARD_COMMIT[_variant].EXT"


def test_supported_benchmarks_say_what_they_measure_and_how_to_run_them() -> None:
    scripts = sorted(path for path in (ROOT / "benchmarks").glob("*.py") if path.name != "__init__.py")
    assert 0 < len(scripts) <= 12
    for script in scripts:
        doc = ast.get_docstring(ast.parse(script.read_text()))
        assert doc, f"{script.name} has no docstring"
        assert f"benchmarks.{script.stem}" in doc, f"{script.name}'s docstring gives no command line"


def test_metrics_catalogue_names_every_metric() -> None:
    from omni_ray.serve.metrics import ServiceMetrics

    catalogue = (ROOT / "docs" / "http-api.md").read_text()
    names = {family.name for family in ServiceMetrics().registry.collect()}
    assert len(names) > 40
    missing = sorted(name for name in names if not re.search(rf"`{name}(_total)?`", catalogue))
    assert not missing, f"docs/http-api.md does not describe: {missing}"


def test_configuration_reference_names_every_setting() -> None:
    from pydantic import BaseModel

    from omni_ray.config import PipelineConfig
    from omni_ray.serve.openai_protocol import ServiceLimits

    reference = (ROOT / "docs" / "configuration.md").read_text()

    def fields(model: type[BaseModel]) -> set[str]:
        names = set()
        for name, field in model.model_fields.items():
            names.add(name)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                names |= fields(field.annotation)
        return names

    missing = sorted(name for name in fields(PipelineConfig) | fields(ServiceLimits)
                     if not re.search(rf"`[^`]*\b{name}\b[^`]*`", reference))
    assert not missing, f"docs/configuration.md does not describe: {missing}"


@pytest.mark.parametrize("markdown", [ROOT / "README.md", *DOCS], ids=_rel)
def test_python_examples_compile_and_import_what_exists(markdown: Path) -> None:
    for block in _code_blocks(markdown.read_text(), "python"):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("omni_ray"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
