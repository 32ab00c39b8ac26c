"""Engines that run a model: the streaming engine (:mod:`.streaming`), the night's entry point
(:mod:`.runtime`), the backends (:mod:`.backends`), and the KV cache (:mod:`.kv_cache`)."""
