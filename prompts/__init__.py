"""The prompt templates shipped with robot-llm (installed as ``robot_llm.prompts``); see README.md."""
