"""The generation child: ``python -m robot_llm.commands.main batch run`` for one night, supervised.

Generation runs in a child process, so an out-of-memory kill or a hang in the model never
takes the scheduler down: the daemon records how the child ended (:class:`ChildOutcome`)
and the next run resumes the same night's queue (the queue lives in the database, and
planning is idempotent).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from robot_llm.clock import aware_utc
from robot_llm.errors import EXIT_BLOCKED, EXIT_REQUESTS_FAILED, RobotLLMError
from robot_llm.night.watchdog import WATCHDOG_EXIT_CODE

if TYPE_CHECKING:
    from robot_llm.config import AppConfig

__all__ = ["ChildOutcome", "child_env", "generate_command", "start_child", "supervise_child"]

log = logging.getLogger("robot_llm.daemon.scheduler")


def generate_command(
    config: AppConfig, as_of: datetime, *, log_format: str = "text", verbosity: int | None = None
) -> list[str]:
    """The command line of the generation child for the night of ``as_of``.

    The child reads its configuration by value on stdin (:func:`start_child` writes the
    daemon's :func:`~robot_llm.config.config_snapshot` there), never the file: a bad edit
    on disk changes nothing until a SIGHUP is accepted, and the night runs the config it
    was planned with. ``-c`` still names the file, for its messages. The child logs in the
    daemon's format; ``verbosity`` is the daemon's ``-v`` count, so the terminal shows what
    the daemon's own shows; None (the daemon logs to stderr, no log file) follows
    ``logging.level``, so one journal holds both at the same level.
    """
    if config.source is None:
        raise RobotLLMError("the daemon needs a config loaded from a file (its messages name it)")
    if verbosity is None:
        verbosity = {"DEBUG": 2, "INFO": 1}.get(config.logging.level, 0)
    return [
        sys.executable,
        "-m",
        "robot_llm.commands.main",
        "batch",
        "run",
        "-c",
        str(config.source),
        "--config-stdin",
        "--as-of",
        aware_utc(as_of, "as_of").isoformat(),
        "--log-format",
        log_format,
        *(["-" + "v" * min(verbosity, 2)] if verbosity > 0 else []),
    ]


def start_child(config: AppConfig, cmd: list[str]) -> subprocess.Popen[bytes]:
    """Start the generation child ``cmd`` and hand it ``config`` by value on its stdin."""
    from robot_llm.config import config_snapshot

    # A new session: a Ctrl-C in the daemon's terminal is ours to forward, not the child's to receive.
    proc = subprocess.Popen(cmd, env=child_env(), start_new_session=True, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        proc.stdin.write(config_snapshot(config).encode("utf-8"))
        proc.stdin.close()
    except OSError as exc:  # it died before reading: its exit status says why
        log.warning("the generation child (pid %d) did not take its config: %s", proc.pid, exc)
    return proc


@dataclass(frozen=True)
class ChildOutcome:
    """How the generation child ended."""

    pid: int
    returncode: int
    stop_requested: bool  # we forwarded SIGTERM because the daemon is stopping
    timed_out: bool  # it ran past batch.child_timeout
    killed_by_us: bool  # it ignored SIGTERM and got SIGKILL after daemon.shutdown_timeout

    @property
    def stalled(self) -> bool:
        """The worker's watchdog ended it: a batch made no progress for ``batch.stall_timeout``."""
        return self.returncode == WATCHDOG_EXIT_CODE

    def describe(self) -> str:
        """One line for logs and ``Run.error``."""
        if self.stalled:
            text = (
                f"the generation child (pid {self.pid}) stopped itself: a batch made no progress "
                "for batch.stall_timeout"
            )
        elif self.returncode < 0:
            sig = signal.Signals(-self.returncode).name
            text = f"the generation child (pid {self.pid}) was killed by {sig}"
            if self.killed_by_us:
                text += " after it ignored SIGTERM for daemon.shutdown_timeout"
            elif -self.returncode == signal.SIGKILL:
                text += " (not by robot-llm: the kernel's out-of-memory killer, or an operator)"
        elif self.returncode == EXIT_REQUESTS_FAILED:
            text = f"the generation child (pid {self.pid}) finished, but requests failed for good (batch status)"
        elif self.returncode == EXIT_BLOCKED:
            text = f"the generation child (pid {self.pid}) could do nothing: another worker holds the queue"
        else:
            text = f"the generation child (pid {self.pid}) exited with code {self.returncode}"
        if self.timed_out:
            text += "; it had run longer than batch.child_timeout"
        return text


def child_env() -> dict[str, str]:
    # The package may run from a checkout (not installed): let the child import it the same way.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([root, *parts])
    return env


def supervise_child(
    proc: subprocess.Popen[bytes],
    *,
    timeout_s: float,
    grace_s: float,
    stop: threading.Event,
    kill_now: threading.Event,
    beat: Callable[[], None],
) -> ChildOutcome:
    """Wait for the child; SIGTERM it on ``stop`` or past ``timeout_s``, SIGKILL ``grace_s`` later (or on ``kill_now``).

    ``beat`` is called every 5 s while it runs (the nightly row's heartbeat and progress).
    """
    started = time.monotonic()
    deadline = started + timeout_s
    term_at: float | None = None
    stop_requested = timed_out = killed = False
    last_beat = started
    while True:
        try:
            returncode = proc.wait(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if term_at is None and (stop.is_set() or now > deadline):
            stop_requested = stop.is_set()
            timed_out = not stop_requested
            log.info("sending SIGTERM to the generation child (pid %d)", proc.pid)
            proc.send_signal(signal.SIGTERM)
            term_at = now
        elif term_at is not None and not killed and (kill_now.is_set() or now - term_at > grace_s):
            log.warning("the generation child (pid %d) did not stop; sending SIGKILL", proc.pid)
            proc.kill()
            killed = True
        if now - last_beat >= 5:
            last_beat = now
            beat()
    return ChildOutcome(proc.pid, returncode, stop_requested, timed_out, killed)
