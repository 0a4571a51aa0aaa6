"""How long a rank lives: no longer than the process that started it, and nothing it started outlives it (Linux).

    launcher ─► fork server ─► rank ─┬─► helper: waits for the rank's death, then kills the rank's process group
     (or torchrun's agent ─► rank)    └─► DataLoader workers, their fork server, any subprocess (the same group)

A rank gets a parent-death signal (SIGKILL), so it ends when its launcher does, however that is killed. What the
rank starts is in the process group it leads; a helper forked from it gets a parent-death signal of its own and
kills that group when the rank ends, however it ends (a DataLoader's workers and the fork server they start from
once kept each other alive forever after their rank was killed). A process that leaves the group (a new session)
is not followed. Elsewhere (no prctl) neither is set: the ranks' timeouts stop them once their launcher is gone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading
import warnings
from collections.abc import Callable

__all__ = ["children_end_with_me", "die_with_parent"]

PR_SET_PDEATHSIG = 1  # from linux/prctl.h
_WAKE = signal.SIGUSR1  # the helper's parent-death signal: it waits for it, blocked, instead of dying of it
_helped: int | None = None  # the process whose helper is running (a forked child inherits this; it is not that one)


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, or None where there is none (not Linux)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(launcher: int | None = None) -> bool:
    """Have the kernel kill this process when its parent dies, by any signal: the launcher's fork server (which exits
    when the launcher does), or torchrun's agent. False where that cannot be set (not Linux).

    The parent may die before the signal is armed: then this process exits at once. Should it have died before this
    call (this process already adopted by another), that is not seen: call it first thing. ``launcher``: a process
    that must be alive too (the fork server's owner), checked after the signal is armed.
    """
    prctl = _prctl()
    if prctl is None:
        return False
    parent = os.getppid()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # died in between: the signal came before it was armed
        os._exit(1)
    if launcher is not None:
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:
            pass
    return True


def children_end_with_me() -> bool:
    """Make every process this one starts from now on (and theirs) end when this one does, however it ends.

    This process leads a process group from now on (under torchrun it already does: the agent starts each rank in a
    session of its own), and a helper forked now kills that group once this process is gone (its parent-death
    signal). Once per process; only from the main thread (the signal follows the thread that forked the helper).
    False where nothing was set: not Linux, another thread, or a group this process cannot lead.
    """
    global _helped
    me = os.getpid()
    if _helped == me:
        return True
    prctl = _prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return False
    if os.getpgid(0) != me:
        try:
            os.setpgid(0, 0)
        except OSError:  # a session leader of another group cannot move: leave its group alone
            return False
    with warnings.catch_warnings():  # Python 3.12+ warns of fork in a process with threads: the helper only waits
        warnings.simplefilter("ignore", DeprecationWarning)
        helper = os.fork()
    if helper:
        _helped = me
        return True
    try:  # the helper: no Python above this frame runs again, and it holds none of the rank's files
        signal.pthread_sigmask(signal.SIG_BLOCK, {_WAKE})
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        prctl(PR_SET_PDEATHSIG, _WAKE, 0, 0, 0)
        while os.getppid() == me:  # a stray SIGUSR1 is not a death
            signal.sigwait({_WAKE})
        os.killpg(me, signal.SIGKILL)  # the group cannot be another's: its helper, a member, is still alive
    finally:
        os._exit(0)
