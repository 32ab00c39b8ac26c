"""robot_llm.llm.store.reader."""
