"""robot-llm's Alembic environment; installed as ``robot_llm.migrations``, driven by ``robot_llm.store.migrate``."""
