"""specserve/triton/parent_death.py: a server started through die_with_parent gets its signal when
the process that started it is killed outright (SIGKILL: no with block, no atexit), keeps the pid
Popen gave, and refuses to run when its parent is already gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specserve.triton.parent_death import die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# The child: reports its pid, then waits for a signal and writes which one it got.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]
    def got(sig, frame):
        open(out, "w").write(str(sig))
        sys.exit(0)
    signal.signal(signal.SIGTERM, got)
    signal.signal(signal.SIGINT, got)
    print(os.getpid(), flush=True)
    time.sleep(600)
""")

# The parent: starts the child wrapped, says the pid Popen gave, then waits to be killed.
PARENT = textwrap.dedent("""
    import signal, subprocess, sys, time
    from specserve.triton.parent_death import die_with_parent
    child = subprocess.Popen(die_with_parent([sys.executable, "-c", sys.argv[1], sys.argv[2]], signal.Signals(int(sys.argv[3]))),
                             stdout=subprocess.PIPE, text=True)
    print(child.pid, child.stdout.readline().strip(), flush=True)
    time.sleep(600)
""")


def wait_for(path: Path, limit_s: float = 120) -> str:
    """The file's text once written: the kernel sends the signal as the parent dies; the limit is
    only a guard against a hang, far beyond how long a loaded machine takes."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if path.is_file() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} was never written: the child outlived its parent")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_child_gets_its_signal_when_the_parent_is_killed(tmp_path, sig):
    out = tmp_path / "got"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(out), str(int(sig))],
                              stdout=subprocess.PIPE, text=True)
    popen_pid, child_pid = parent.stdout.readline().split()
    assert popen_pid == child_pid   # exec'd in place: the pid the parent holds is the server's
    assert not out.exists()
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_for(out) == str(int(sig))


def test_a_child_whose_parent_is_already_gone_does_not_run(tmp_path):
    cmd = die_with_parent([sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'w')"])
    cmd[cmd.index(str(os.getpid()))] = "1"   # as if the parent had died before the child's prctl
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 1 and "exited before it ran" in run.stderr
    assert not (tmp_path / "ran").exists()
