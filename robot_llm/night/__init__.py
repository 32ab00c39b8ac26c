"""robot_llm.night."""
