"""The process's signal handling, kept from native libraries that change it.

oneDNN from the package index runs its CPU kernels on Intel's SYCL/OpenCL CPU runtime, which,
when oneDNN creates its engine (estimax's first convolution), installs handlers of its own for
15 signals (SIGHUP, SIGINT, SIGQUIT, SIGILL, SIGTRAP, SIGABRT, SIGBUS, SIGFPE, SIGUSR1,
SIGSEGV, SIGUSR2, SIGTERM, SIGXCPU, SIGXFSZ, SIGSYS: read from ``/proc/self/status``'s
``SigCgt`` before and after), over signals the process ignored too. When one of them arrives it
puts back the dispositions it found at install time, all at once: a ``nohup``'d trainer (SIGHUP
ignored) that gets a SIGHUP has its SIGTERM reset to the default (if the engine came first) and
dies of the next SIGTERM without saving.

So the dispositions are read before a native library may change them and put back right after
(``kept``), and the loop checks the ones it relies on at each host sync (``Keeper``). Both read
the kernel's ``sigaction`` itself: Python's ``signal.getsignal`` only reports what Python last
set, not what native code did since.

Why not receive signals where native code cannot reach them (``sigwait``/``signalfd`` in a
thread)? Both need the signal blocked in every thread of the process, and XLA's and oneDNN's
threads exist before Python could block anything in them; ``signal.set_wakeup_fd`` is written by
Python's own C handler, the very disposition that gets replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
from collections.abc import Iterable, Iterator

from absl import logging

# Larger than ``struct sigaction`` on any libc (glibc x86-64: 152 bytes; macOS: 16). Its first
# member is the handler on every libc; the rest of glibc's copy is partly uninitialised (its
# 1024-bit mask holds the kernel's 64 bits), so only the handler is compared.
_SIGACTION_BYTES = 512
_HANDLER_BYTES = ctypes.sizeof(ctypes.c_void_p)
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}
STANDARD_SIGNALS = tuple(
    s for s in signal.valid_signals() if isinstance(s, signal.Signals) and s not in _UNCATCHABLE
)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sigaction  # noqa: B018 - present on POSIX only
    except (OSError, AttributeError, TypeError):
        return None
    return libc


_LIBC = _libc()


def snapshot(signums: Iterable[int] = STANDARD_SIGNALS) -> dict[int, bytes]:
    """``{signal: its sigaction as the kernel holds it}`` (empty where there is no sigaction)."""
    if _LIBC is None:
        return {}
    found = {}
    for signum in signums:
        buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if _LIBC.sigaction(int(signum), None, buf) == 0:
            found[int(signum)] = buf.raw
    return found


def restore(saved: dict[int, bytes]) -> list[str]:
    """Puts back every disposition of ``saved`` that has changed; the changed signals' names."""
    if _LIBC is None or not saved:
        return []
    changed = []
    for signum, was in snapshot(saved).items():
        if was[:_HANDLER_BYTES] != saved[signum][:_HANDLER_BYTES]:
            _LIBC.sigaction(signum, ctypes.create_string_buffer(saved[signum]), None)
            changed.append(signal.Signals(signum).name)
    return changed


@contextlib.contextmanager
def kept(what: str) -> Iterator[None]:
    """Runs the block (native code named ``what``), then undoes its changes to any signal."""
    saved = snapshot()
    try:
        yield
    finally:
        changed = restore(saved)
        if changed:
            logging.debug("%s changed the handlers of %s; put back.", what, ", ".join(changed))


class Keeper:
    """Holds the dispositions of a few signals as they are now; ``check`` puts them back.

    A change that Python code made (``signal.signal``) is the program's own and is kept; only
    changes made behind Python's back (by native code) are undone.

    Args:
      signums: the signals whose handling the caller relies on.
    """

    def __init__(self, signums: Iterable[int]):
        self._signums = [int(s) for s in signums]
        self._saved = snapshot(self._signums)
        self._python = {s: signal.getsignal(s) for s in self._signums}

    def check(self) -> list[str]:
        """Restores any of the signals that native code changed since; their names (warned).

        Two ``sigaction`` reads: about 8 us (ctypes), so it runs once per host loop.
        """
        for s in self._signums:
            if signal.getsignal(s) is not self._python[s]:  # set from Python since: kept
                self._python[s] = signal.getsignal(s)
                self._saved.update(snapshot([s]))
        changed = restore(self._saved)
        if changed:
            logging.warning(
                "Native code replaced the handler of %s; estimax put its own back so that a "
                "preemption notice still saves.",
                ", ".join(changed),
            )
        return changed
