"""robot_llm.commands."""
