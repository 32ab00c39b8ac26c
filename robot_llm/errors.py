"""The project's error taxonomy.

``RobotLLMError`` and its subclasses carry a message meant for the user: the CLI prints it
as one line and exits non-zero, with a traceback only under ``-vv``. Anything else is a bug.
"""

from __future__ import annotations


class RobotLLMError(Exception):
    """A problem the user can fix (bad input, missing file, unreachable server...)."""

    exit_code = 2
