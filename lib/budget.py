"""`python bench.py check`'s machinery: parts run in turn within one time budget, each its own process
(group), killed at its timeout and, on Linux, with the check; the report is rewritten after every row.

Each part gets what is left minus the shares of the parts after it (unused time passes on); a part whose
time would fall under its floor is not started, and its rows say so. SIGTERM and Ctrl-C stop the running
part, mark the rest and write the report: a killed check leaves every finished row on disk.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections import deque

from lib.cli import atomic_write_text, json_text, write_json

ROW = "ROW "
PASSED = ("ok", "skipped")  # the others: failed, error, timed out, not run, stopped, pending, running
PR_SET_PDEATHSIG = 1


def emit(label: str, **fields) -> None:
    """In a part's process: one row (or an update of it) for the check, on stdout."""
    print(ROW + json_text({"row": label, **fields}), flush=True)


@dataclasses.dataclass
class Part:
    name: str
    argv: list[str] | None          # its process; None when it cannot run here (`blocked` says why)
    rows: list[str]                 # the rows it is planned to fill (pytest's rows come as they run)
    share: float                    # of the budget: reserved for it while earlier parts run
    floor: float = 0.0              # seconds: with less time than this it is not started
    blocked: str = ""
    blocked_status: str = "not run"  # or "skipped": a part that does not apply here (GPU tests on a CPU)
    kind: str = ""                  # how the report shows its rows (the caller's render knows)
    env: dict | None = None
    finish: callable = None         # (exit status, or None when stopped) -> [(row label, fields)], at its end


class Stopped(Exception):
    """SIGTERM or SIGINT arrived while the plan ran."""


class Report:
    """The rows and the plan, in out_dir/check.json and check.md, rewritten after every change."""

    def __init__(self, out_dir: str, header: dict, render, line):
        self.out_dir, self.header, self.render, self.line = out_dir, header, render, line
        self.rows, self.parts = [], []

    def row(self, part: str, label: str) -> dict:
        found = next((r for r in self.rows if r["part"] == part and r["row"] == label), None)
        if found is None:
            found = {"part": part, "row": label, "status": "pending"}
            self.rows.append(found)
        return found

    def update(self, part: str, label: str, fields: dict) -> None:
        """Change a row, rewrite the report, print the row when it has just got its result."""
        row = self.row(part, label)
        before = row["status"]
        row.update(fields)
        self.write()
        if row["status"] != before and row["status"] not in ("pending", "running"):
            print(self.line(row), flush=True)

    def document(self) -> dict:
        statuses = {r["status"] for r in self.rows}
        return {**self.header, "parts": self.parts, "rows": self.rows,
                "complete": not statuses & {"pending", "running"}, "ok": statuses <= set(PASSED)}

    def write(self) -> None:
        """Both files, atomically; SIGTERM and SIGINT wait until both are written."""
        signals = {signal.SIGTERM, signal.SIGINT}
        mask = getattr(signal, "pthread_sigmask", lambda how, signals: None)  # Windows: no signal mask
        mask(signal.SIG_BLOCK, signals)
        try:
            write_json(self.document(), os.path.join(self.out_dir, "check.json"))
            atomic_write_text(os.path.join(self.out_dir, "check.md"), self.render(self.document()) + "\n")
        finally:
            mask(signal.SIG_UNBLOCK, signals)


def run_plan(parts: list[Part], budget: float, report: Report, log) -> None:
    """Every part in turn, each under its timeout; `log` an open text file."""
    deadline = time.monotonic() + budget
    for part in parts:
        report.parts.append({"part": part.name, "status": "pending"})
        for label in part.rows:
            report.row(part.name, label)
    report.write()
    with stop_on_signals():
        for i, part in enumerate(parts):
            reserved = sum(p.share * budget for p in parts[i + 1:] if p.argv)
            timeout = deadline - time.monotonic() - reserved
            entry = report.parts[i]
            try:
                if not part.argv or timeout < part.floor:
                    why = part.blocked or (f"{max(timeout, 0):.0f} s of the {budget:.0f} s budget left for "
                                           f"it, it needs {part.floor:.0f} s")
                    status = part.blocked_status if part.blocked else "not run"
                    entry.update(status=status, detail=why)
                    close_rows(report, part, status, why)
                    continue
                entry.update(status="running", timeout_s=round(timeout, 1))
                run_part(part, timeout, report, entry, log)
            except Stopped as stop:
                why = f"the check was stopped ({stop})"
                for j in range(i, len(parts)):  # this part stopped, the later ones not run
                    status = "stopped" if j == i else "not run"
                    report.parts[j].update(status=status, detail=why)
                    close_rows(report, parts[j], status, why)
                raise


def run_part(part: Part, timeout: float, report: Report, entry: dict, log) -> None:
    start = time.monotonic()
    process = subprocess.Popen(part.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", env=part.env, **OWN_GROUP)
    entry["pid"] = process.pid
    lines, tail = start_reader(process), deque(maxlen=40)
    timed_out = False
    try:
        while True:
            try:
                line = lines.get(timeout=max(start + timeout - time.monotonic(), 0.001))
            except queue.Empty:
                timed_out = True
                break
            if line is None:
                break
            take_line(part, line, report, tail, log)
    finally:
        stop_group(process)
    status = None if timed_out else process.returncode
    for label, fields in part.finish(status) if part.finish else []:
        report.update(part.name, label, fields)
    if timed_out:
        outcome, why = "timed out", f"timed out after {timeout:.0f} s (its share of the budget)"
    elif status:
        outcome, why = "failed", f"the part exited with status {status}: {tail[-1] if tail else 'no output'}"
    else:
        outcome, why = "ok", "the part ended without this row"
    entry.update(seconds=round(time.monotonic() - start, 1), exit=status, status=outcome,
                 **({} if outcome == "ok" else {"detail": why}))
    close_rows(report, part, "timed out" if timed_out else "error", why)


def take_line(part: Part, line: str, report: Report, tail: deque, log) -> None:
    """A row `emit` printed updates the report; any other line goes to the log (the last ones: `tail`)."""
    if not line.startswith(ROW):
        log.write(f"[{part.name}] {line}")
        log.flush()
        if line.strip():
            tail.append(line.strip())
        return
    try:
        fields = json.loads(line[len(ROW):])
        label = fields.pop("row")
    except (ValueError, KeyError) as e:  # a torn or foreign line: logged, never fatal
        log.write(f"[{part.name}] (unreadable row: {e})\n")
        return
    report.update(part.name, label, fields)


def close_rows(report: Report, part: Part, status: str, why: str) -> None:
    """Every row of `part` without a result gets `status` and why (a part that made no row: one, its name)."""
    rows = [r for r in report.rows if r["part"] == part.name] or [report.row(part.name, part.name)]
    for row in rows:
        if row["status"] in ("pending", "running"):
            earlier = row.get("detail")  # what a running row said last (its first call's time, say)
            detail = f"{why}; {earlier}" if earlier else why
            report.update(part.name, row["row"], {"status": status, "detail": detail})
    report.write()


def start_reader(process) -> queue.Queue:
    """The process's lines on a queue (None after the last), read by a thread: the check never blocks."""
    lines = queue.Queue()

    def read():
        for line in process.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=read, daemon=True).start()
    return lines


def own_group_dying_with_parent() -> None:
    """In the part's process before it runs: its own process group; (Linux) SIGKILL when the check dies."""
    os.setpgid(0, 0)
    with contextlib.suppress(Exception):
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


LIBC = ctypes.CDLL(None) if os.name == "posix" else None  # here: between fork and exec nothing should load
# Windows has no fork (preexec_fn) and no process groups to kill: there a part is its own process only
OWN_GROUP = dict(preexec_fn=own_group_dying_with_parent) if os.name == "posix" else {}


def stop_group(process) -> None:
    """SIGKILL to the part's process group (its children too), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.name == "posix":
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    process.wait()
    with contextlib.suppress(OSError):
        process.stdout.close()


@contextlib.contextmanager
def stop_on_signals():
    """While the plan runs, SIGTERM and SIGINT end it with Stopped (in the main thread)."""
    def stop(signum, frame):
        raise Stopped(f"{signal.Signals(signum).name} after {time.monotonic() - started:.0f} s")
    started = time.monotonic()
    saved = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
