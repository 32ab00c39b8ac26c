"""Model families: each family's config and forward pass, and the interface they share (:mod:`.family`)."""
