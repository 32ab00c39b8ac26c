"""Engines that run a model: the streaming engine (:mod:`.streaming`), the whole model in memory
(:mod:`.memory`), DeepSpeed (:mod:`.deepspeed`), built only by :mod:`.backends` for the door
(:meth:`robot_llm.llm.model.Model.open`); the policy an open model keeps and the task each job
passes (:mod:`.policy`), the settings and planning behind the door (:mod:`.runtime`), and the KV
cache (:mod:`.kv_cache`)."""
