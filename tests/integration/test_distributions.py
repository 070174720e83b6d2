"""The three distributions build from this repository with standard tools, carry their own
names and dependencies, and a fresh virtual environment that installs them imports and
runs them (third-party dependencies are taken from the test environment's site-packages,
so the test needs no network; PerCache itself comes only from the wheels)."""

from __future__ import annotations

import email
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = {
    "percache-core": (ROOT, "percache_core"),
    "percache-llamaindex": (ROOT / "percache_llamaindex", "percache_llamaindex"),
    "percache-langchain": (ROOT / "percache_langchain", "percache_langchain"),
}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    built = {}
    for name, (project, _) in PROJECTS.items():
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(project)],
            check=True,
            cwd=out,
            capture_output=True,
        )
        built[name] = next(out.glob(f"{name.replace('-', '_')}-*.whl"))
    return built


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        path = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(archive.read(path))


def test_each_wheel_has_its_own_name_package_and_dependencies(wheels):
    for name, wheel in wheels.items():
        meta = metadata(wheel)
        assert meta["Name"] == name  # never "percache": that name belongs to another project
        with zipfile.ZipFile(wheel) as archive:
            top = {n.split("/")[0] for n in archive.namelist() if not n.split("/")[0].endswith(".dist-info")}
        assert top == {PROJECTS[name][1]}
        assert not any(n.endswith("pyproject.toml") for n in zipfile.ZipFile(wheel).namelist())
        assert not any("fake" in n for n in zipfile.ZipFile(wheel).namelist())  # test doubles stay in tests/
    requires = {  # what installing the distribution brings, extras aside
        name: " ".join(r for r in metadata(w).get_all("Requires-Dist") or [] if "extra ==" not in r)
        for name, w in wheels.items()
    }
    assert "llama-index-core" in requires["percache-llamaindex"] and "percache-core" in requires["percache-llamaindex"]
    assert "langchain-core" in requires["percache-langchain"] and "percache-core" in requires["percache-langchain"]
    assert "llama-index" not in requires["percache-core"] and "langchain" not in requires["percache-core"]


def test_a_fresh_venv_installs_the_wheels_and_runs_them(wheels, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", *map(str, wheels.values())],
        check=True,
        capture_output=True,
    )
    script = textwrap.dedent("""
        import numpy as np, percache_core, percache_llamaindex, percache_langchain
        from percache_core import PerCache, PerCacheConfig
        from fake_engine import FakeEngine  # the tests' double: not in the wheel

        class Embedder:
            name, dimension = "bag-of-letters", 26
            def embed(self, texts):
                rows = np.zeros((len(texts), 26), dtype=np.float32)
                for row, text in zip(rows, texts):
                    for ch in text.lower():
                        if "a" <= ch <= "z":
                            row[ord(ch) - 97] += 1
                return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-9)

        with PerCache.open("cache", config=PerCacheConfig(max_new_tokens=8), engine=FakeEngine(), embedder=Embedder()) as pc:
            pc.add_documents(["The rehearsal is on Friday at 3 pm in room B."])
            first, again = pc.answer("When is the rehearsal?"), pc.answer("When is the rehearsal?")
            assert again.source == "prompt_answer" and again.text == first.text
        print(percache_core.__file__)
        print(percache_llamaindex.__file__)
    """)
    site_packages = sysconfig.get_paths()["purelib"]  # numpy, tqdm, llama-index-core, ...
    result = subprocess.run(
        [str(python), "-c", script],
        cwd=tmp_path,
        env={"PYTHONPATH": f"{site_packages}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    files = result.stdout.split()
    assert all(str(env_dir) in f for f in files)  # from the wheels, not from this checkout
