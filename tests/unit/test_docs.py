"""The documentation cannot drift: the site builds in strict mode (a broken link, anchor or
reference to a missing name fails), every setting and public name is documented, and the
README stays short. Its code blocks run in ``tests/integration/test_readme.py``."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import percache_core
from percache_core.config import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_every_setting_is_documented_in_its_section() -> None:
    for name, section in SECTIONS.items():
        attributes = (section.__doc__ or "").split("Attributes:", 1)
        assert len(attributes) == 2, f"{section.__name__} has no Attributes section"
        for field in dataclasses.fields(section):
            assert re.search(rf"^\s+{field.name}:", attributes[1], re.M), f"{name}.{field.name} is undocumented"


def documented_names() -> set[str]:
    """Names a reference page renders with ``::: module.Name`` (a whole module renders
    its public names)."""
    names: set[str] = set()
    for page in REFERENCE.glob("*.md"):
        names |= {match.rsplit(".", 1)[-1] for match in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M)}
    return names


def test_every_public_name_has_a_docstring_and_a_reference_entry() -> None:
    rendered = documented_names()
    missing, undocumented = [], []
    for name in percache_core.__all__:
        if name.startswith("__"):
            continue
        value = getattr(percache_core, name)
        if not (inspect.getdoc(value) or "").strip():
            undocumented.append(name)
        if name not in rendered:
            missing.append(name)
    for package in ("percache_llamaindex", "percache_langchain"):
        assert package in rendered, f"{package} has no reference page"
        module = __import__(package)
        undocumented += [n for n in module.__all__ if not (inspect.getdoc(getattr(module, n)) or "").strip()]
    assert not undocumented, f"no docstring: {undocumented}"
    assert not missing, f"not in docs/reference: {missing}"


def test_the_readme_is_read_in_five_minutes() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


def test_every_python_block_of_the_docs_parses() -> None:
    """The pages' Python blocks are at least valid Python (the README's also run:
    ``tests/integration/test_readme.py``)."""
    import ast

    broken = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            try:
                ast.parse(block)
            except SyntaxError as error:
                broken.append(f"{page.name}: {error}")
    assert not broken, "\n".join(broken)
