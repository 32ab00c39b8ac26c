"""The morning report: what ran and how it went (:mod:`.summary`), and its HTML page (:mod:`.html`)."""
