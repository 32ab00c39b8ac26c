"""robot-llm: overnight LLM theses for a trading robot's instruments, read point-in-time."""

__version__ = "0.1.0"
