"""Servers that do not outlive the process that started them.

A benchmark that runs llama.cpp in process died of a segfault in its library and left its
`specserve serve` children, and their tritonservers, running: holding ports, memory and the
cores the next measurement needs. A `with` block cannot clean up after a signal that kills the
interpreter, so each child asks the kernel instead: `die_with_parent(cmd, sig)` wraps a command
so that it sets PR_SET_PDEATHSIG (Linux) and then execs the command in the same process (same
pid), which then gets `sig` when its parent dies: SIGTERM for `specserve serve` (it drains and
stops its tritonserver), SIGINT for tritonserver (its graceful shutdown).

The signal comes when the parent's *thread* that started the child exits, not only the whole
process: start servers from a thread that outlives them (the main thread, everywhere here).
Elsewhere than Linux the command is returned as it is.
"""

from __future__ import annotations

import os
import signal
import sys

# Run by a fresh interpreter (-I -S: no site, no environment) before the exec. prctl(1, sig) is
# PR_SET_PDEATHSIG; it survives execve. A parent that died before the prctl ran would never send
# the signal, so the child checks that its parent is still the one that started it.
_EXEC = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.prctl(1, int(sys.argv[1]), 0, 0, 0) != 0:\n"
    "    raise OSError(ctypes.get_errno(), 'prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    sys.exit('the process that started ' + sys.argv[3] + ' exited before it ran')\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def die_with_parent(cmd: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """`cmd` wrapped to receive `sig` when this process (the thread calling Popen) dies."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-I", "-S", "-c", _EXEC, str(int(sig)), str(os.getpid()), *map(str, cmd)]
