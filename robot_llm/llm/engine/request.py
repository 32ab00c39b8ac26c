"""What the command line asks a backend for (:class:`ModelRequest`), and the error a backend refuses it with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from robot_llm.errors import RobotLLMError
from robot_llm.llm.families.config import YalmConfig


@dataclass(frozen=True)
class ModelRequest:
    """What the user asked for on the command line.

    ``checkpoint`` is a release folder (or anything the backend understands,
    e.g. a weight store); ``dtype`` is ``fp32``/``bf16``/``fp16``; ``device`` a
    torch device string; ``home`` (``disk``/``ram``) and ``offload``
    (``cpu``/``nvme``) only mean something to the offloading engines and are
    None when not given.
    """

    checkpoint: Path
    config: YalmConfig
    dtype: str = "fp32"
    device: str = "cpu"
    home: str | None = None
    offload: str | None = None
    trust_pickle: bool = False


class BackendError(RobotLLMError):
    """The chosen backend does not exist or cannot serve the request."""
