"""Several test cases run in one child Python process, each reported on its own line, so that a crash (a SIGBUS is
exit -7), an exit or a hang is still the failure of the case that caused it.

The parent gives the child the cases as JSON on argv[1]: a list of [case id, parameters]. The child runs them in
order and, after each, prints `CASE_LINE` + JSON [case id, result] (`report_cases` does this). A case whose line
does not come within `timeout_s` of the previous one (or of the start) is killed; a child that dies is attributed
to the first case without a line, and a fresh child runs the cases after it, so every case gets its own outcome.
Paying the interpreter and torch import once instead of once per case is the point (~1.3 s each).
`report_forked_cases` is the variant for memory probes: one process per case, forked after the imports.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE_LINE = "CHILD_CASE "


@dataclass
class Outcome:
    result: object = None
    failure: str | None = None  # why the case has no result: the child's death, its exit status and stderr

    def value(self):
        """The case's result; fails the calling test with the child's story if the case has none."""
        assert self.failure is None, self.failure
        return self.result


def report_cases(run_case) -> None:
    """The child's side: `run_case(parameters)` for each case given on argv[1], its result printed as it ends."""
    for case, parameters in json.loads(sys.argv[1]):
        print(CASE_LINE + json.dumps([case, run_case(parameters)]), flush=True)


def report_forked_cases(run_case) -> None:
    """The child's side, for measurements that need a fresh process per case: this process (imports done) forks
    one process per case given on argv[1], all at once; each runs `run_case(parameters)`, so each starts from this
    process's state, as freshly imported as a new interpreter's, and sees no other case's allocations. A case's
    result is {"exit": its process's exit status, and "result": what `run_case` returned, or "error": the
    traceback of what it raised}."""
    children = {}
    for case, parameters in json.loads(sys.argv[1]):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            code = 1
            try:
                report = {"result": run_case(parameters)}
                code = 0
            except BaseException:
                import traceback

                report = {"error": traceback.format_exc()}
            finally:
                os.write(write, json.dumps(report).encode())
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write)
        children[case] = (pid, read)
    for case, (pid, read) in children.items():
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
        report = json.loads(data) if data else {}
        print(CASE_LINE + json.dumps([case, {"exit": os.waitstatus_to_exitcode(status), **report}]), flush=True)


def forked_result(outcome: Outcome):
    """What `report_forked_cases` reported for a case: `run_case`'s result, failing the test if its process failed."""
    child = outcome.value()
    assert child["exit"] == 0 and "error" not in child, (
        f"the case's process exited with {child['exit']} (a SIGBUS is -7)\n{child.get('error', '')}")
    return child["result"]


def run_cases(script: str, cases: dict[str, object], *, timeout_s: float, env=None, cwd=ROOT) -> dict[str, Outcome]:
    """Run `script` (which calls `report_cases`) over `cases` (id -> JSON-able parameters); an Outcome per id."""
    outcomes: dict[str, Outcome] = {}
    pending = list(cases.items())
    while pending:
        done = _one_child(script, pending, timeout_s, env, cwd)
        outcomes.update(done)
        pending = [(case, parameters) for case, parameters in pending if case not in outcomes]
    return outcomes


def _one_child(script, pending, timeout_s, env, cwd) -> dict[str, Outcome]:
    outcomes = {}
    with tempfile.TemporaryFile("w+") as stderr:  # a file, not a pipe: a chatty child cannot block on it
        # A session of its own, so that a timeout kills the processes it forked too (`report_forked_cases`).
        proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(pending)], cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                                  daemon=True)
        reader.start()
        timed_out = False
        while True:
            try:
                line = lines.get(timeout=timeout_s)
            except queue.Empty:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                break
            if line is None:
                break
            if line.startswith(CASE_LINE):
                case, result = json.loads(line[len(CASE_LINE):])
                outcomes[case] = Outcome(result)
        code = proc.wait()
        reader.join(timeout=10)
        proc.stdout.close()
        stderr.seek(0)
        story = stderr.read()[-3000:]
    missing = [case for case, _ in pending if case not in outcomes]
    if missing:
        why = f"no line within {timeout_s} s: killed" if timed_out else f"the child exited with {code} (a SIGBUS is -7)"
        outcomes[missing[0]] = Outcome(failure=f"case {missing[0]!r}: {why}\n{story}")
    elif code != 0:  # every case reported, then the child failed: say so on the last one
        outcomes[pending[-1][0]] = Outcome(failure=f"the child exited with {code} after its last case\n{story}")
    return outcomes
