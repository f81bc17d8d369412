"""`python -m h3_core ...` run inside the test process: the CLI's `main(argv)` with the working folder, the
environment and stdout/stderr of a fresh run, but without the 1.3 s a child interpreter spends importing torch.

What a child process would add is checked where it matters: the README command and the signal tests still start a
real `python -m h3_core` (tests/test_pipeline.py, tests/test_outputs.py, tests/test_remote_contract.py). An uncaught
exception here propagates into the test and fails it, where a child would have printed a traceback."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class CliRun:
    """What a finished CLI run left: its exit code and everything it printed."""

    returncode: int
    stdout: str
    stderr: str


def run_cli_in_process(argv, *, cwd, monkeypatch, capsys, environment=None) -> CliRun:
    """Run `python -m h3_core ARGV` in folder `cwd` with `environment` changes (a value of None unsets the variable);
    everything is put back afterwards."""
    from h3_core.app import cli

    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        for name, value in (environment or {}).items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, os.fspath(value))
        capsys.readouterr()  # what the test printed before is not the CLI's
        try:
            returncode = cli.main([os.fspath(arg) if isinstance(arg, os.PathLike) else arg for arg in argv])
        except SystemExit as exit:  # argparse's own refusals
            returncode = exit.code if isinstance(exit.code, int) else 1
        printed = capsys.readouterr()
    return CliRun(returncode, printed.out, printed.err)


def default_sigint() -> None:
    """`preexec_fn` of a child the test will interrupt: a suite started in the background (`pytest &`) runs with
    SIGINT ignored, children inherit that, and a Python started with SIGINT ignored never raises KeyboardInterrupt.
    Set back to the default, the child's interpreter installs its KeyboardInterrupt handler as in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
