"""Child stage processes that die with their parent, and stopping a running stage by its pid.

`pipeline.py run` starts each stage as a child. Without care a SIGKILLed parent leaves that child
running (and holding the stage lock), so the rerun finds the stage "already running". Two guards:
the child asks Linux to send it SIGTERM when its parent dies (PR_SET_PDEATHSIG), and it runs in a
process group of its own, so `stop` or a supervisor can signal the stage and every process under it
(torchrun's workers) at once. Imports no torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux; a no-op elsewhere).
    SIGTERM, not SIGKILL: a stage stops cleanly on it (train saves a checkpoint, caches keep their
    written rows). If the parent already died before the call, exit now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not fatal: the process group still lets `stop` reach the stage
    if os.getppid() != parent_pid or parent_pid == 1:
        os._exit(1)


CHILD_ENV = "LORAPIPE_DIE_WITH_PARENT"  # set for a stage child; torchrun's workers inherit it


def start_child(command: Sequence[str]) -> subprocess.Popen:
    """Start one stage as a child in its own process group, set to die with this process."""
    parent = os.getpid()
    # preexec_fn runs in the forked child before exec, and the death signal survives exec. Only the
    # main thread starts children here, so the fork-with-threads caveat of preexec_fn does not apply.
    return subprocess.Popen(list(command), process_group=0, env={**os.environ, CHILD_ENV: "1"},
                            preexec_fn=lambda: die_with_parent(parent))


def die_with_parent_if_asked() -> None:
    """In a stage process started by `start_child`, or by the torchrun it started: die with the
    parent. torchrun stops its workers when it gets SIGTERM, but not when it is SIGKILLed."""
    if os.environ.get(CHILD_ENV) == "1":
        die_with_parent(os.getppid())


def call_child(command: Sequence[str]) -> int:
    """Run one stage as a child and wait. SIGINT/SIGTERM sent to this parent are passed on to the
    child (once: it is not in the terminal's foreground group, so Ctrl-C reaches it only through
    here), which stops cleanly (train saves a checkpoint first); torchrun passes them to its workers."""
    child = start_child(command)

    def forward(signum: int, frame: object) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def signal_group(pid: int, sig: int = signal.SIGTERM) -> None:
    """Send `sig` to the process group led by `pid` (a child of `call_child`), or to `pid` alone when
    it leads no group (a stage started by hand or by torchrun); a process already gone is fine."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
