"""robot_llm.llm.engine.streaming."""
