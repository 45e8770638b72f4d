"""Run one ``duetime`` CLI command as a subprocess and capture what it printed.

One helper for every test that checks a command's exit status, stdout and stderr
(``jobs``, ``schedules``, ``migrate``, ``status``, ``bench``): bounded by a timeout, and
the child is killed (never left behind) when the test gives up on it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from tests.support.procs import duetime_argv


class Run(NamedTuple):
    """A finished command; unpacks as ``code, out, err``."""

    code: int
    out: str
    err: str

    def json(self) -> object:
        return json.loads(self.out)

    def error_line(self) -> str:
        """The single stderr line of a failed command (asserts there is exactly one)."""
        lines = self.err.strip().splitlines()
        assert len(lines) == 1, f"expected one stderr line, got:\n{self.err}"
        assert "Traceback" not in self.err
        assert lines[0].startswith("duetime: error: "), lines[0]
        return lines[0][len("duetime: error: ") :]


async def run_duetime(
    env: Mapping[str, str], *args: str, timeout: float = 30.0, cwd: Path | None = None
) -> Run:
    """``duetime *args`` with exactly ``env``; its exit status and decoded output."""
    proc = await asyncio.create_subprocess_exec(
        *duetime_argv(*args),
        env=dict(env),
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(), err.decode())
