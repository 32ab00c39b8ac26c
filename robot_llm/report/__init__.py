"""robot_llm.report.summary."""
