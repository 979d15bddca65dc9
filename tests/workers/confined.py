"""Runs a Python script as `python SCRIPT ARGS` would, in this process, confined
first: without root's file-permission capabilities, or in a private mount
namespace with a small tmpfs (tests/integration/test_backup_read_errors.py,
tests/integration/test_outputs.py).

    python confined.py [--drop_dac] [--tmpfs DIR SIZE] [--first_copy SRC DST]
                       [--then_copy SRC DST] -- SCRIPT ARGS

--drop_dac: CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped from every set
(bounding, effective, permitted, inheritable), as `capsh --drop=...` does:
root can then not read a file of mode 0.
--tmpfs: a private mount namespace (mounts private, as `unshare -m` makes
them) with a tmpfs of SIZE (mount's `size=`, e.g. 1m) on DIR; it dies with
this process.
--first_copy: SRC's files copied into folder DST before the script starts
(into the tmpfs, say).
--then_copy: once the script ended, however it ended, SRC's files copied into
folder DST (out of the tmpfs, before it goes).

Exits as the script does. Done with system calls rather than by exec'ing
`capsh` or `unshare`, so that it runs in a process forked from the tests'
warm server (`tests._util.run_python_warm`: TensorFlow imported already).
"""

import argparse
import ctypes
import os
import runpy
import shutil
import sys

_LIBC = ctypes.CDLL(None, use_errno=True)
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2
_PR_CAPBSET_DROP = 24
_CAPABILITY_VERSION_3 = 0x20080522
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_dac() -> None:
    """This thread's file-permission capabilities gone (before any thread starts:
    new threads inherit them)."""
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        _check(_LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), "prctl(PR_CAPBSET_DROP)")
    header, data = _Header(_CAPABILITY_VERSION_3, 0), (_Data * 2)()
    _check(_LIBC.capget(ctypes.byref(header), data), "capget")
    mask = ~((1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH)) & 0xFFFFFFFF
    for field in ("effective", "permitted", "inheritable"):
        setattr(data[0], field, getattr(data[0], field) & mask)
    _check(_LIBC.capset(ctypes.byref(header), data), "capset")


def private_tmpfs(folder: str, size: str) -> None:
    _check(_LIBC.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_LIBC.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None),
           "mount --make-rprivate /")
    _check(_LIBC.mount(b"tmpfs", os.fsencode(folder), b"tmpfs", 0, f"size={size}".encode()),
           f"mount tmpfs on {folder}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drop_dac", action="store_true")
    parser.add_argument("--tmpfs", nargs=2, metavar=("DIR", "SIZE"))
    parser.add_argument("--first_copy", nargs=2, metavar=("SRC", "DST"))
    parser.add_argument("--then_copy", nargs=2, metavar=("SRC", "DST"))
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    if options.tmpfs:
        private_tmpfs(*options.tmpfs)
    if options.first_copy:
        shutil.copytree(*options.first_copy, symlinks=True, dirs_exist_ok=True)
    if options.drop_dac:
        drop_dac()
    sys.argv = [options.script, *options.args]
    sys.path[0] = os.path.dirname(os.path.abspath(options.script))
    code = 0
    try:
        runpy.run_path(options.script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        if options.then_copy:
            shutil.copytree(*options.then_copy, symlinks=True, dirs_exist_ok=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
