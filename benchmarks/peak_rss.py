"""A command's peak resident memory, measured from outside it, as GNU time's
`%M` (`time -f %M`) measures it: the kernel's `ru_maxrss` of the child,
read by `wait4` when it ends. Needs no package (Debian's `time` is not
always installed).

    python -m benchmarks.peak_rss [--limit_bytes=N] -- COMMAND [ARG...]

runs COMMAND, passes its output through, then prints `peak_rss_kb N` to
stderr, and `peak_anon_kb N`: the largest anonymous resident memory seen
in COMMAND's process while it ran (`RssAnon` of /proc/PID/status, read every
20 ms: a lower bound; what a memory limit cannot reclaim, where the
resident set also counts the libraries' pages, which it can), and exits
with COMMAND's status (128 + the signal's number where a
signal ended it, as a shell reports it). With `--limit_bytes`, COMMAND runs
in a cgroup of its own (cgroup v1 memory controller; root) limited to N
bytes, as a per-process memory limit of a cluster's scheduler: over it, the
kernel kills it (137); a second line, `oom_kills N`, says how many of its
processes the kernel killed for memory. The cgroup is removed after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["ANON_LINE", "LINE", "OOM_LINE", "limit_unavailable", "main", "parse"]

LINE = "peak_rss_kb"
"""The word before the kilobytes on the line it prints."""
OOM_LINE = "oom_kills"
ANON_LINE = "peak_anon_kb"
_CGROUPS = "/sys/fs/cgroup/memory"


def parse(output: str, word: str = LINE) -> list[int]:
    """The bytes of every `peak_rss_kb N` line in `output`, in order (with
    `word`=ANON_LINE: of the `peak_anon_kb N` lines; OOM_LINE: the counts of
    the `oom_kills N` lines)."""
    scale = 1 if word == OOM_LINE else 1024
    return [int(line.split(word, 1)[1].split()[0]) * scale
            for line in output.splitlines() if word + " " in line]


def limit_unavailable() -> str | None:
    """Why `--limit_bytes` cannot be given here (no cgroup can be made), or None."""
    if os.geteuid() != 0:
        return "not root: cgroups cannot be made"
    if not os.path.exists(os.path.join(_CGROUPS, "memory.limit_in_bytes")):
        return f"no cgroup v1 memory controller at {_CGROUPS}"
    return None


def _cgroup(limit_bytes: int) -> str:
    """A new memory cgroup limited to `limit_bytes` (memory and swap)."""
    path = os.path.join(_CGROUPS, f"tfmulti-peak-rss-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(path)
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
        if os.path.exists(os.path.join(path, name)):  # (memsw: where swap is accounted)
            with open(os.path.join(path, name), "w") as f:
                f.write(str(limit_bytes))
    return path


def _oom_kills(path: str) -> int:
    with open(os.path.join(path, "memory.oom_control")) as f:
        fields = dict(line.split() for line in f if line.strip())
    return int(fields.get("oom_kill", 0))


def _anon_kb(pid: int) -> int:
    """`RssAnon` of process `pid` in kB (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _in_proc(pid: int) -> int:
    """This process's only child `pid` as /proc numbers it: under `tfmulti
    launch` the workers run in a PID namespace of their own, and /proc is the
    host's (its `self` is this process there)."""
    me = os.readlink("/proc/self")
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            children = f.read().split()
    except OSError:
        return pid
    return int(children[0]) if len(children) == 1 else pid


def _wait(pid: int) -> tuple[int, object, int]:
    """Waits for `pid`: (its wait status, its rusage, its largest `RssAnon` seen, kB)."""
    anon, seen = 0, _in_proc(pid)
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage, anon
        anon = max(anon, _anon_kb(seen))
        time.sleep(0.02)


def _remove(path: str) -> None:
    for _ in range(50):  # the last task's exit is accounted a moment later
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


def main(argv: list[str]) -> int:
    limit = None
    if argv[:1] and argv[0].startswith("--limit_bytes="):
        limit = int(argv[0].split("=", 1)[1])
        argv = argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or (limit is not None and limit <= 0):
        print("usage: python -m benchmarks.peak_rss [--limit_bytes=N] -- COMMAND [ARG...]",
              file=sys.stderr)
        return 2
    cgroup = _cgroup(limit) if limit is not None else None

    def join_cgroup():  # in the child, before COMMAND starts: its pid as this namespace sees it
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    try:
        preexec = join_cgroup if cgroup else None  # (this process runs no threads)
        process = subprocess.Popen(argv, preexec_fn=preexec)  # noqa: PLW1509
        # SIGTERM and SIGINT reach the command (the launcher's stop): wait on.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda number, _: process.send_signal(number))
        status, usage, anon = _wait(process.pid)
        code = os.waitstatus_to_exitcode(status)
        print(f"{LINE} {usage.ru_maxrss}", file=sys.stderr, flush=True)
        print(f"{ANON_LINE} {anon}", file=sys.stderr, flush=True)
        if cgroup:
            print(f"{OOM_LINE} {_oom_kills(cgroup)}", file=sys.stderr, flush=True)
    finally:
        if cgroup:
            _remove(cgroup)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
