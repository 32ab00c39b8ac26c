"""The project's error taxonomy.

``RobotLLMError`` and its subclasses carry a message meant for the user: the CLI prints it
as one line and exits non-zero, with a traceback only under ``-vv``. Anything else is a bug.
"""

from __future__ import annotations

#: Exit status of ``batch run`` / ``demo`` when some requests failed for good (theses are missing).
EXIT_REQUESTS_FAILED = 1
#: Exit status of ``batch run`` when nothing could be done: another live worker holds the SQLite queue.
EXIT_BLOCKED = 4
# The others: 0 all done (or ``batch run`` stopped cleanly on request); 2 a RobotLLMError below;
# 3 the watchdog ended a stalled batch (robot_llm.night.watchdog.WATCHDOG_EXIT_CODE); 128 + N the
# demo stopped by signal N (130 Ctrl-C, 143 SIGTERM).


class RobotLLMError(Exception):
    """A problem the user can fix (bad input, missing file, unreachable server...)."""

    exit_code = 2
