"""The project's error taxonomy.

``RobotLLMError`` and its subclasses carry a message meant for the user: the CLI prints it
as one line and exits non-zero, with a traceback only under ``-vv``. Anything else is a bug.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

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


class ModelFault(RobotLLMError):
    """The model cannot be trusted right now: damaged or unreadable weights, non-finite values.

    No request is to blame, so a worker stops the night at once, gives its claimed requests
    back (their attempt not counted) and stores nothing from the batch in flight.
    """


class BackendError(RobotLLMError):
    """The chosen backend does not exist or cannot serve the request (the family, a flag it does not take)."""


# Optional dependencies and the extra that installs each (pyproject.toml), for the one-line
# error an entry point gives when it needs one that is not installed.
EXTRAS: dict[str, str] = {
    "torch": "model",
    "deepspeed": "model",
    "safetensors": "model",
    "numpy": "model",
    "xxhash": "model",
    "psycopg": "postgres",
    "pandas": "pandas",
    "pyarrow": "feather",
    "plotly": "report",
    "freqtrade": "freqtrade",
}


def missing_extra(exc: BaseException) -> str | None:
    """The one line for an optional dependency that is not installed (``exc`` a ModuleNotFoundError), else None."""
    if not isinstance(exc, ModuleNotFoundError):
        return None
    name = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra is None:
        return None
    return f"this command needs {name}, which is not installed: pip install 'robot-llm[{extra}]'"


def closed_pipe() -> int:
    """The reader of our output went away (``| head``): stop quietly with 0, as ``git log | head`` does.

    Python would report the pipe again when it flushes stdout at exit; stdout goes to
    /dev/null first.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


def run_main(main: Callable[[], int]) -> int:
    """Run a ``python -m`` entry point: a missing extra in one line (exit 1), a closed pipe quietly (exit 0)."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return closed_pipe()
    except ModuleNotFoundError as exc:
        line = missing_extra(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1
