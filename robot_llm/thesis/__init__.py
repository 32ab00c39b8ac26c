"""robot_llm.thesis."""
