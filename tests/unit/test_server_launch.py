"""How a llama-server PerCache starts is launched: the batch-invariant launch's flags,
environment and binary, and the CLI's refusal of it for a server it does not start."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from percache_core import LlamaServer, ServerLaunch
from percache_core.cli import main
from percache_core.engines.llama_server import launch_choice
from percache_core.engines.llama_server.launch_choice import with_kernels_chosen
from percache_core.engines.llama_server.server_http import ServerError
from percache_core.engines.llama_server.server_process import (
    BINARY_ENV,
    INVARIANT_BINARY_ENV,
    find_server_binary,
)


def test_the_invariant_launch_turns_the_batch_dependent_paths_off_and_the_default_keeps_them() -> None:
    plain, invariant = ServerLaunch(n_slots=2), ServerLaunch(n_slots=2, batch_invariant=True)
    assert "-nr" not in plain.flags() and plain.environment() == {}
    flags = invariant.flags()
    assert "-nr" in flags and flags[flags.index("-fa") + 1] == "on" and "-no-kvu" in flags  # (until measured)
    off = ServerLaunch(n_slots=2, batch_invariant=True, flash_attention="off").flags()
    assert off[off.index("-fa") + 1] == "off" and "-fa" not in ServerLaunch(flash_attention="off").flags()
    assert invariant.environment() == {"GGML_CPU_TILED_MM": "0"}  # (until measured)
    assert flags[: len(plain.flags())] == plain.flags()  # the same slots, context and batches, then the switches


def test_the_invariant_launch_runs_its_own_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = tmp_path / "llama-server-invariant"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    plain = tmp_path / "llama-server"
    plain.write_text("#!/bin/sh\n")
    plain.chmod(0o755)
    monkeypatch.setenv(INVARIANT_BINARY_ENV, str(binary))
    monkeypatch.setenv(BINARY_ENV, str(plain))
    assert find_server_binary(batch_invariant=True) == binary
    assert find_server_binary() == plain  # the plain launch keeps its own
    monkeypatch.setenv(INVARIANT_BINARY_ENV, str(tmp_path / "missing"))  # nor beside this Python, nor on PATH:
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))           # the error says how to build it
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(ServerError, match="make llama-server-invariant"):
        find_server_binary(batch_invariant=True)


def test_serve_refuses_batch_invariant_for_a_server_it_does_not_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--upstream", "http://127.0.0.1:1", "--batch-invariant"]) == 2
    assert "--batch-invariant" in capsys.readouterr().err


def test_an_invariant_launch_takes_the_kernels_measured_fastest_once_per_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERCACHE_HOME", str(tmp_path / "home"))
    model, binary = tmp_path / "model.gguf", tmp_path / "llama-server-invariant"
    model.write_bytes(b"GGUF")
    binary.write_text("#!/bin/sh\n")
    measured: list[tuple[str | None, str | None]] = []
    seconds = {("on", "on"): 2.0, ("on", "off"): 3.0, ("off", "on"): 1.5, ("off", "off"): 1.0}

    def request_seconds(_model: Path, launch: ServerLaunch) -> float:
        measured.append((launch.flash_attention, launch.tiled_matmul))
        return seconds[(launch.flash_attention or "", launch.tiled_matmul or "")]

    monkeypatch.setattr(launch_choice, "_request_seconds", request_seconds)
    launch = ServerLaunch(batch_invariant=True, binary=binary)
    chosen = with_kernels_chosen(model, launch)
    assert (chosen.flash_attention, chosen.tiled_matmul) == ("off", "off") and len(measured) == 4
    assert chosen.environment() == {"GGML_CPU_TILED_MM": "0"}
    assert with_kernels_chosen(model, launch) == chosen and len(measured) == 4  # kept on disk
    pinned = with_kernels_chosen(model, replace(launch, flash_attention="on"))  # the other one measured
    assert (pinned.flash_attention, pinned.tiled_matmul) == ("on", "on") and measured[4:] == [("on", "on"), ("on", "off")]
    assert pinned.environment() == {"GGML_CPU_TILED_MM_FORCE": "1"}
    fixed = replace(launch, flash_attention="on", tiled_matmul="off")
    assert with_kernels_chosen(model, fixed) == fixed and with_kernels_chosen(model, ServerLaunch()) == ServerLaunch()
    assert len(measured) == 6  # given, or not invariant: nothing measured
    model.write_bytes(b"GGUF, another model")  # another model file: measured again
    with_kernels_chosen(model, launch)
    assert len(measured) == 10
    for name in ("flash_attention", "tiled_matmul"):
        with pytest.raises(ValueError, match=name):
            LlamaServer.start(model, replace(fixed, **{name: "yes"}))


def test_an_invariant_servers_states_are_keyed_by_its_binary_not_only_by_its_build_info() -> None:
    def server(invariant: bool, digest: str | None) -> LlamaServer:
        attached = LlamaServer(url="http://127.0.0.1:9")  # nothing is sent: /props is given
        attached._props = {"build_info": "b1-same-commit", "model_path": "", "total_slots": 2,
                           "default_generation_settings": {"n_ctx": 2048}}
        attached.batch_invariant, attached.binary_digest = invariant, digest
        return attached

    # every build of one commit reports the same build_info: a rebuilt invariant binary
    # (other kernels) must not restore the states an older one kept
    assert server(True, "a" * 64).fingerprint("x") != server(True, "b" * 64).fingerprint("x")
    assert server(True, "a" * 64).fingerprint("x") == server(True, "a" * 64).fingerprint("x")
    assert server(False, None).fingerprint("x") != server(True, "a" * 64).fingerprint("x")
