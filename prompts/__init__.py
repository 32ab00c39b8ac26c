"""Prompt templates shipped with robot-llm (importable so an installed package can find them)."""
