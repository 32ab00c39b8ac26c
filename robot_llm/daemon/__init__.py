"""The daemon: one long-running scheduler that decides *when* each stage runs.

:mod:`.scheduler` wires APScheduler; :mod:`.lease` keeps one scheduler per database;
:mod:`.jobs` holds the short jobs (feed polls, signal folders, the morning report);
:mod:`.nightly` decides whether tonight runs, plans it and supervises the generation child.
"""
