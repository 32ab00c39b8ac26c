"""What a stored thesis is worth, checked before it is stored: :mod:`.validity` (the store
boundary's rules: non-empty, finite, or an explicit abstention), :mod:`.checks` (the direction
the text states against its stance, degeneration), :mod:`.rows` (the night's row kinds and
flags, the "no inputs" abstention) and :mod:`.priors` (doctor's warnings about label priors
and templates). No torch."""
