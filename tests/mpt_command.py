"""`mpt` commands as real processes, forked from the session's pre-imported server.

``python -m mp_toolkit.cli train ...`` spends about 2.5 s of CPU importing torch and the toolkit
before it parses a flag; the tests start a few hundred such commands. Here each command is a process
of its own, forked from the test session's fork server (`tests.dist_harness.fork_context`, which has
imported torch and ``mp_toolkit.cli`` and never ran a kernel, a thread pool or a process group): it
gets the test's environment and working directory, its own session (so a timeout kills it with
every rank it started), stdout and stderr in files, and runs `mp_toolkit.cli.main` as the ``mpt``
script does (``fork_ranks=True``: `mpt train` forks its ranks from it as from a fresh ``mpt``). Its
exit code is the one the script would give (a signal: minus its number, as Popen reports it).

The tests about processes themselves (`tests/test_fault_tolerance.py`, `test_spawn.py`,
`test_save_dir_and_ports.py`, the torchrun and launcher runs) start ``python -m mp_toolkit.cli``
interpreters instead, so that path stays covered.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mp_toolkit import cli
from tests.dist_harness import fork_context


def _entry(argv: list[str], environ: dict[str, str], cwd: str, out: str, err: str | None) -> None:
    """The forked command: the test's environment and directory, output to files, `mpt argv`."""
    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err_fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if err is not None else out_fd
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.argv = [cli.__file__, *argv]
    sys.exit(cli.main(argv, fork_ranks=True))  # multiprocessing turns SystemExit(code) into the exit code


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class MptProcess:
    """One running `mpt argv`; the part of subprocess.Popen's interface the tests use (text output)."""

    def __init__(self, argv: list, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 merge_stderr: bool = False):
        argv = [str(a) for a in argv]  # paths and numbers as the command line would spell them
        self.args = ["mpt", *argv]
        self._dir = Path(tempfile.mkdtemp(prefix="mpt-command-"))
        self._out = self._dir / "stdout"
        self._err = None if merge_stderr else self._dir / "stderr"
        environ = dict(os.environ if env is None else env)
        self._proc = fork_context().Process(
            target=_entry, daemon=True,
            args=(argv, environ, str(cwd or os.getcwd()), str(self._out),
                  None if self._err is None else str(self._err)))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; subprocess.TimeoutExpired (the process left running) after ``timeout`` s."""
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the command and every process of its session (the ranks it started)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.kill()  # killed before its setsid, it has no session of its own yet

    def output(self) -> tuple[str, str | None]:
        """(stdout, stderr) written so far; stderr None when merged into stdout."""
        return _read(self._out), None if self._err is None else _read(self._err)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Wait for the exit (TimeoutExpired after ``timeout`` s, the process left running), then the output."""
        self.wait(timeout)
        out = self.output()
        self.close()
        return out

    def close(self) -> None:
        """Kill what is left of the command and drop its output files."""
        if self.poll() is None:
            self.kill()
            self.wait(30)
        shutil.rmtree(self._dir, ignore_errors=True)


def run_mpt(argv: list, env: dict[str, str] | None = None, cwd: str | Path | None = None,
            timeout: float = 300.0, merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """What ``subprocess.run([python, "-m", "mp_toolkit.cli", *argv], capture_output=True, text=True,
    timeout=timeout)`` returns; past ``timeout`` the command and its ranks are killed and
    subprocess.TimeoutExpired is raised with the output so far."""
    proc = MptProcess(argv, env=env, cwd=cwd, merge_stderr=merge_stderr)
    started = time.monotonic()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        out, err = proc.output()
        proc.close()
        raise subprocess.TimeoutExpired(proc.args, time.monotonic() - started, output=out, stderr=err) from None
    out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
