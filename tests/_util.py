"""Helpers shared by the tests: fresh Python processes, recipe runs and local
clusters, each with a timeout."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
WORKERS = REPO / "tests" / "workers"


def file_tree(path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under `path` (to prove nothing changed)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def run_python(args: list[str], timeout: float = 240, env: dict | None = None,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Runs `python ARGS` in a fresh process (own TF runtime) with a timeout."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout,
        env=full_env, cwd=cwd or REPO,
    )


def run_recipe(name: str, *flags: str, timeout: float = 240,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `python recipes/NAME.py FLAGS` in a fresh process."""
    return run_python([str(RECIPES / f"{name}.py"), *flags], timeout=timeout, env=env)


def launch_local(command: list[str], num_workers: int = 2, startup_timeout: float = 120,
                 **options) -> tuple[int, str]:
    """Runs `command` as a local cluster with `tfmulti.cluster.launch` (isolated,
    every worker reaped): (exit status, everything the launcher printed)."""
    from tfmulti.cluster import launch

    out = io.StringIO()
    code = launch(command, num_workers=num_workers, output=out,
                  startup_timeout=startup_timeout, **options)
    return code, out.getvalue()


def launch_python(args: list[str], **options) -> tuple[int, str]:
    """`launch_local([python, *args])`."""
    return launch_local([sys.executable, *args], **options)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
