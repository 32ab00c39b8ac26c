"""The track record: every stored thesis scored against what the market did next, point-in-time
(:mod:`.ledger`). Torch-free, read by :mod:`robot_llm.forecasts` and the morning report."""
