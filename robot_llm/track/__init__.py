"""The track record: every stored thesis scored against what the market did next, point-in-time.

:mod:`.ledger` states the definitions and builds the ledger's groups; :mod:`.outcomes` reads
theses and closes and scores each thesis's entry, exit and return; :mod:`.stats` holds the
ranks, the per-thesis terms and the bootstrap over nights; :mod:`.figures` one group's figures
and their settings; :mod:`.ab` the A/B comparison. Torch-free, read by
:mod:`robot_llm.forecasts` and the morning report.
"""
