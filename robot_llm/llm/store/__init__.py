"""The weight store: its files and manifest (:mod:`.reader`, :mod:`.layout`), writing and importing
into it (:mod:`.writer`, :mod:`.importers`, :mod:`.checkpoint`), quantisation (:mod:`.quant`) and
large reads (:mod:`.diskio`)."""
