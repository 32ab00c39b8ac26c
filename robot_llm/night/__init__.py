"""One night's work, in the order it happens.

:mod:`.plan` renders the generation requests; :mod:`.preflight` checks everything the night
needs; :mod:`.child` is the supervised ``batch run`` process; :mod:`.worker` claims requests
from :mod:`.queue`, runs the model opened by :mod:`.model` and stores theses with their
:mod:`.stance`; :mod:`.watchdog` keeps the worker's heartbeat and lease.
"""
