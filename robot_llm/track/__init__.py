"""robot_llm.track."""
