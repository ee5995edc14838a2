"""Worker processes that end with the process they work for.

A ``ProcessPoolExecutor`` worker blocked in a read (a stalled file, a slow image) does not
notice that its parent died: killing ``estimax-convert`` with SIGKILL left its workers running
under PID 1 until killed by hand. ``exit_with_parent``, run first in the pool's initializer,
ends a worker the moment the process it works for ends, however that ends.

Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (through ctypes: no maintained package wraps it
without a compiled extension of its own) has the kernel kill the worker when its direct parent
dies: the converter's workers. The loader's workers are children of its forkserver, which
outlives the loader while any worker lives (each worker holds the forkserver's liveness pipe),
so a worker whose owner is not its parent also waits on a pidfd of the owner (``pidfd_open``,
Linux 5.3+) in a daemon thread and exits when it becomes readable; once the workers are gone the
forkserver and multiprocessing's resource tracker see their pipes close and exit too.
Elsewhere (macOS, Windows, older kernels) there is neither: the daemon thread polls the owner
once a second instead, so a worker outlives its owner by up to a second.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import sys
import threading

__all__ = ["exit_with_parent"]

# <linux/prctl.h>
_PR_SET_PDEATHSIG = 1
_POLL_SECS = 1.0


def exit_with_parent(owner_pid: int) -> None:
    """Makes this process exit when ``owner_pid`` does; a pool's ``initializer``.

    Args:
      owner_pid: the process this worker works for (``os.getpid()`` there, passed through
        ``initargs``): the parent itself, or the process whose forkserver is the parent.
        If it is already gone when the worker starts (it died before anything was armed, so
        no signal will come), the worker exits at once.
    """
    parent = os.getppid()
    linux = sys.platform.startswith("linux")
    if linux:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if not linux or owner_pid != parent:
        threading.Thread(
            target=_watch_owner,
            args=(owner_pid, parent),
            name="estimax-exit-with-owner",
            daemon=True,
        ).start()
    # The parent (or the owner) died between this process's start and now: no signal comes.
    if os.getppid() != parent or not _alive(owner_pid):
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM  # exists, owned by someone else
    return True


def _watch_owner(owner_pid: int, parent: int) -> None:
    """Exits this process when ``owner_pid`` ends (or this process's parent changes)."""
    try:
        pidfd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # not Linux 5.3+
        pidfd = None
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the owner has exited
        os._exit(1)
    stop = threading.Event()  # never set: wait() is the pause between polls
    while _alive(owner_pid) and os.getppid() == parent:
        stop.wait(_POLL_SECS)
    os._exit(1)
