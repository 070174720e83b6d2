"""The shape of the code, read statically (``make lint`` runs the layer check; this file runs
in the suite): small classes and functions, short public signatures, settings in small
typed sections, modes compared only where their policy lives, and settings read through
their sections inside the packages.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from percache_core.config import SECTION_OF, SECTIONS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "percache_core", ROOT / "percache_llamaindex", ROOT / "percache_langchain"]
MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 60
MAX_PUBLIC_PARAMETERS = 6  # a request or options object counts as one
MAX_SECTION_FIELDS = 20
# where each mode is compared: its policy, and the section that defines it
MODE_HOMES = {
    "qa_mode": {"percache_core/policies/answers.py"},
    "reuse": {"percache_core/policies/states.py"},
    "context": {"percache_core/config.py"},
}


def sources() -> list[tuple[str, ast.Module]]:
    """(path relative to the repository, parsed module) of every package module."""
    found = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            if "build" not in path.relative_to(package).parts:
                found.append((path.relative_to(ROOT).as_posix(), ast.parse(path.read_text("utf-8"))))
    return found


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined, operator]


def test_classes_and_functions_are_small() -> None:
    too_long = []
    for path, module in sources():
        for node in ast.walk(module):
            if isinstance(node, ast.ClassDef) and lines(node) > MAX_CLASS_LINES:
                too_long.append(f"{path}: class {node.name}, {lines(node)} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines(node) > MAX_FUNCTION_LINES:
                too_long.append(f"{path}:{node.lineno}: {node.name}, {lines(node)} lines")
    assert not too_long, "\n".join(too_long)


def test_public_signatures_are_short() -> None:
    long_ones = []
    for path, module in sources():
        for node in ast.walk(module):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name.startswith("_") and node.name != "__init__":
                continue
            arguments = node.args
            names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
            count = len([name for name in names if name not in ("self", "cls")])
            if count > MAX_PUBLIC_PARAMETERS:
                long_ones.append(f"{path}:{node.lineno}: {node.name}, {count} parameters")
    assert not long_ones, "\n".join(long_ones)


def test_settings_come_in_small_typed_sections_that_cover_every_flat_name() -> None:
    for name, section in SECTIONS.items():
        fields = dataclasses.fields(section)
        assert len(fields) <= MAX_SECTION_FIELDS, f"{name}: {len(fields)} fields"
    assert len(SECTION_OF) == sum(len(dataclasses.fields(section)) for section in SECTIONS.values())


def test_modes_are_compared_only_where_their_policy_lives() -> None:
    """No ``config.tiers.qa_mode == ...`` outside the answer policy (and so on): the
    request path, the caller verbs and idle work ask the policy."""
    wrong = []
    for path, module in sources():
        for node in ast.walk(module):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                if not isinstance(side, ast.Attribute) or side.attr not in MODE_HOMES or path in MODE_HOMES[side.attr]:
                    continue
                owner = side.value
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if owner_name in ("tiers", "retrieval", "config", "self"):  # a setting, not another attribute
                    wrong.append(f"{path}:{node.lineno}: compares {side.attr}")
    assert not wrong, "\n".join(wrong)


def test_the_packages_read_settings_through_their_sections() -> None:
    """Inside the packages a setting is read as ``config.<section>.<name>``; the flat
    ``config.<name>`` stays a convenience for users."""
    flat = []
    for path, module in sources():
        for node in ast.walk(module):
            if isinstance(node, ast.Attribute) and node.attr in SECTION_OF:
                owner = node.value
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if owner_name in ("config", "_config", "current"):
                    flat.append(f"{path}:{node.lineno}: {owner_name}.{node.attr}")
    assert not flat, "\n".join(flat)
