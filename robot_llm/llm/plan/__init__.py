"""The memory planner (:mod:`.planner`), its time model (:mod:`.timing`) and what it knows about a
machine (:mod:`.machine`, :mod:`.rates`)."""
