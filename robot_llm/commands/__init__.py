"""The ``robot-llm`` command line: one module per command group, argument parsing only.

:mod:`.main` builds the parser from every group's ``register(subparsers, common)`` and turns
errors into one line and an exit code; :mod:`.common` holds what the groups share (loading the
config, opening the database). The work itself is done by the pipeline's packages.
"""
