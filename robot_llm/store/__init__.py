"""The database: the SQLAlchemy schema and sessions (:mod:`.db`), migrations (:mod:`.migrate`)
and the ``runs`` table's row lifecycle (:mod:`.runs`)."""
