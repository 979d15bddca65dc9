"""A quiet start: TensorFlow's C++ start-up lines kept out of tfmulti's output (no TensorFlow).

TensorFlow's shared libraries write a few lines to stderr as they load, before
absl's logging is set up, so `TF_CPP_MIN_LOG_LEVEL` does not silence them:
absl's "All log messages before absl::InitializeLog() is called are written to
STDERR", oneDNN's "oneDNN custom operations are on", the CUDA stub's "Could not
find cuda drivers", each once per library that carries absl (twice), and, when
the runtime starts on a host without an NVIDIA driver, "failed call to cuInit".

`install()` (the `tfmulti` command and the recipes call it first) sets
`TF_CPP_MIN_LOG_LEVEL=2` unless it is set, and when something first imports
TensorFlow or Keras it routes this process's stderr (file descriptor 2, which
C++ writes to) through a small filter process that drops exactly those lines
and passes everything else through as it comes: tfmulti's lines, Python's
warnings and tracebacks, TensorFlow's real warnings and errors, a crash's
last words. The filter ignores SIGINT and SIGTERM and ends when the last
writer of the pipe does; at exit the process waits (briefly) for it, so the
last lines arrive before the shell's prompt. `tfmulti launch` drops the same
lines from its workers' stderr (`startup_filter`), whatever program they run.

Set `TFMULTI_TF_LOG=1` to see TensorFlow's log as TensorFlow writes it: no
filter, and `TF_CPP_MIN_LOG_LEVEL` left as it is (0 shows its INFO lines too).
While filtered, stderr is a pipe, not the terminal.

Example:
    >>> from tfmulti.utils import quiet
    >>> keep = quiet.startup_filter(environ={}, nvidia_driver=False)
    >>> keep("WARNING: All log messages before absl::InitializeLog() is called are "
    ...      "written to STDERR\\n")
    False
    >>> keep("I0000 00:00:1796316347.852164   10324 port.cc:153] oneDNN custom operations "
    ...      "are on. You may see slightly different numerical results.\\n")
    False
    >>> keep("E0000 00:00:1796316352.407030   10324 cuda_platform.cc:52] failed call to "
    ...      "cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\\n")
    False
    >>> keep("E0000 00:00:1796316352.407030   10324 collective_ops.cc:12] peer down\\n")
    True
    >>> keep("tfmulti: MirroredStrategy with 2 replicas\\n")
    True
    >>> quiet.startup_filter(environ={"TFMULTI_TF_LOG": "1"}) is None
    True
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys

__all__ = ["ENV", "StreamFilter", "install", "is_startup_line", "startup_filter",
           "tf_log_wanted"]

ENV = "TFMULTI_TF_LOG"
"""The variable that asks for TensorFlow's own log: 1 (or true, yes) shows it unfiltered."""
_TF_MODULES = ("tensorflow", "keras", "tf_keras", "tensorflow_datasets")
_EXIT_WAIT_S = 2.0  # how long exit waits for the filter to pass the last lines on
_IGNORED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                 if hasattr(signal, name))
"""What the filter ignores: it ends when its writers do (a stop signal to the process group
must not cut this process's stderr off)."""

_ABSL_PREINIT = ("WARNING: All log messages before absl::InitializeLog() is called are "
                 "written to STDERR")
# absl's C++ format (I0000 00:00:1796316347.852164   10324 port.cc:153] ...) and
# TensorFlow's older one (2026-12-03 10:00:00.123456: I tensorflow/.../port.cc:153] ...).
_CPP_LINE = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:[\d.]+\s+\d+ |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] )"
    r"(?:[\w.+-]+/)*(?P<file>[\w.+-]+):\d+\] (?P<message>.*)$")
_STARTUP = (  # (the C++ file, how its start-up message begins)
    ("port.cc", "oneDNN custom operations are on."),
    ("cudart_stub.cc", "Could not find cuda drivers on your machine"),
    ("cpu_feature_guard.cc", "This TensorFlow binary is optimized to use available CPU "
                             "instructions"),
    ("cuda_fft.cc", "Unable to register cuFFT factory"),
    ("cuda_dnn.cc", "Unable to register cuDNN factory"),
    ("cuda_blas.cc", "Unable to register cuBLAS factory"),
    ("computation_placer.cc", "computation placer already registered"),
    ("py_utils.cc", "TF-TRT Warning: Could not find TensorRT"),
)
_NO_DRIVER = (("cuda_platform.cc", "failed call to cuInit"),
              ("cuda_executor.cc", "failed call to cuInit"),
              ("cuda_driver.cc", "failed call to cuInit"))
"""cuInit's failure: a start-up line where the host has no NVIDIA driver, an error where it has
one (kept)."""
_CONTINUED = "To enable the following instructions:"  # cpu_feature_guard's second line
_HELD_MAX = 8192  # a partial line longer than this is no start-up line


def tf_log_wanted(environ=None) -> bool:
    """Whether `TFMULTI_TF_LOG` asks for TensorFlow's own log (1, true, yes, on).

    Example:
        >>> tf_log_wanted({"TFMULTI_TF_LOG": "1"}), tf_log_wanted({"TFMULTI_TF_LOG": "0"})
        (True, False)
    """
    value = (os.environ if environ is None else environ).get(ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def _nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia/version")


def is_startup_line(line: str, *, nvidia_driver: bool | None = None) -> bool:
    """Whether `line` is one of TensorFlow's C++ start-up lines (see the module's doc).

    Args:
        line: one line of output, with or without its newline.
        nvidia_driver: whether this host has an NVIDIA driver (None: look), which makes
            "failed call to cuInit" an error to keep.
    """
    line = line.rstrip("\r\n")
    if line == _ABSL_PREINIT:
        return True
    match = _CPP_LINE.match(line)
    if not match:
        return False
    known = _STARTUP
    if not (_nvidia_driver() if nvidia_driver is None else nvidia_driver):
        known += _NO_DRIVER
    file, message = match["file"], match["message"]
    return any(file == f and message.startswith(m) for f, m in known)


def startup_filter(environ=None, *, nvidia_driver: bool | None = None):
    """A function of one output line that says whether to keep it (False for a start-up
    line), for one stream, in order; None when `TFMULTI_TF_LOG` asks for everything.

    It also drops the line that continues cpu_feature_guard's ("To enable the following
    instructions: ...") right after it.
    """
    if tf_log_wanted(environ):
        return None
    driver = _nvidia_driver() if nvidia_driver is None else nvidia_driver
    dropped = [False]

    def keep(line: str) -> bool:
        if dropped[0] and line.startswith(_CONTINUED):
            dropped[0] = False
            return False
        dropped[0] = is_startup_line(line, nvidia_driver=driver)
        return not dropped[0]

    return keep


class StreamFilter:
    """Bytes in, bytes out, start-up lines dropped (`startup_filter`). A partial line
    goes out at once, unless it may still become a start-up line (it begins as one),
    so progress bars and prompts are not held back.

    Example:
        >>> f = StreamFilter(nvidia_driver=False)
        >>> f.feed(b"I0000 00:00:17.5  7 cudart_stub.cc:31] Could not find cuda drivers on ")
        b''
        >>> f.feed(b"your machine, GPU will not be used.\\nEpoch 1/2\\r 1/8 ")
        b'Epoch 1/2\\r 1/8 '
        >>> f.feed(b"[===]\\n") + f.close()
        b'[===]\\n'
    """

    def __init__(self, *, nvidia_driver: bool | None = None):
        self._keep = startup_filter({}, nvidia_driver=nvidia_driver)
        self._held = bytearray()
        self._mid_line = False  # the current line's start went out already

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        if self._mid_line:
            end = data.find(b"\n")
            if end < 0:
                return bytes(data)
            out += data[:end + 1]
            data = data[end + 1:]
            self._mid_line = False
        self._held += data
        while (end := self._held.find(b"\n")) >= 0:
            line = bytes(self._held[:end + 1])
            del self._held[:end + 1]
            if self._keep(line.decode("utf-8", "replace")):
                out += line
        if self._held and not self._may_be_startup(bytes(self._held)):
            out += self._held
            self._held.clear()
            self._mid_line = True
        return bytes(out)

    def close(self) -> bytes:
        """What is held at the end (a last line without its newline)."""
        rest = bytes(self._held)
        self._held.clear()
        return rest if rest and self._keep(rest.decode("utf-8", "replace")) else b""

    @staticmethod
    def _may_be_startup(partial: bytes) -> bool:
        if len(partial) > _HELD_MAX:
            return False
        text = partial.decode("utf-8", "replace")
        if _ABSL_PREINIT.startswith(text) or _CONTINUED.startswith(text[:len(_CONTINUED)]):
            return True
        # absl's header: a level letter and 4 digits; TensorFlow's: a date.
        return bool(re.match(r"^(?:[IWEF]\d{0,4}(?: |$)|\d{1,4}(?:-|$))", text))


# ------------------------------------------------------------------ this process's stderr

class _StartOnImport:
    """A meta path entry that starts the filter when TensorFlow or Keras is first imported,
    then steps aside (it finds nothing itself)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in _TF_MODULES:
            _remove_hook()
            _start_filter()
        return None


_HOOK = _StartOnImport()
_started = False


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_HOOK)
    except ValueError:
        pass


def install(environ=None) -> bool:
    """Keeps TensorFlow's C++ start-up lines out of this process's stderr, unless
    `TFMULTI_TF_LOG` asks for them. Call it before anything imports TensorFlow (a
    no-op after): it sets `TF_CPP_MIN_LOG_LEVEL=2` unless set, and the filter starts
    when TensorFlow or Keras is first imported, so a command that fails before
    TensorFlow starts no process. Where no pipe or process can be made, stderr stays
    as it is.

    Returns:
        whether the filter will start (False: TFMULTI_TF_LOG set, TensorFlow already
        imported, installed already, or not a POSIX system).
    """
    environ = os.environ if environ is None else environ
    if tf_log_wanted(environ):
        return False
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if (_started or _HOOK in sys.meta_path or any(m in sys.modules for m in _TF_MODULES)
            or os.name != "posix"):
        return False
    sys.meta_path.insert(0, _HOOK)
    return True


def _start_filter() -> None:
    global _started
    if _started or not sys.executable:
        return
    _started = True
    try:
        os.fstat(2)
    except OSError:  # no stderr at all
        return
    saved = os.dup(2)
    read, write = os.pipe()
    # The filter starts with the stop signals blocked (the mask is inherited), and ignores
    # them before it unblocks them: no moment where a signal to the group would end it.
    # Here they wait until the mask is restored, not lost.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _IGNORED)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=read, stdout=saved, stderr=saved, env={}, close_fds=True)
    except OSError:
        for fd in (saved, read, write):
            os.close(fd)
        return
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(read)
    sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)
    atexit.register(_finish, proc, saved)


def _finish(proc: subprocess.Popen, saved: int) -> None:
    """At exit: stderr back to where it was, and the filter given time to pass the last
    lines on (it ends when no process writes to the pipe any more)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os.dup2(saved, 2)
    os.close(saved)
    try:
        proc.wait(timeout=_EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        pass  # a child of this process still holds the pipe; the filter outlives us


def _write_all(fd: int, data: bytes) -> bool:
    while data:
        try:
            data = data[os.write(fd, data):]
        except OSError:
            return False  # the reader is gone (a closed pipe): drain on, write nothing
    return True


def _run_filter() -> None:
    """The filter process: stdin (the pipe) to stdout (the original stderr)."""
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)  # it ends when its writers do
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _IGNORED)  # blocked until now (_start_filter)
    stream, writing = StreamFilter(), True
    while data := os.read(0, 65536):
        if writing:
            writing = _write_all(1, stream.feed(data))
    if writing:
        _write_all(1, stream.close())


if __name__ == "__main__":
    _run_filter()
