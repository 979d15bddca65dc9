"""Helpers shared by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_python(args: list[str], timeout: float = 240, env: dict | None = None,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Runs `python ARGS` in a fresh process (own TF runtime) with a timeout."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout,
        env=full_env, cwd=cwd or REPO,
    )
