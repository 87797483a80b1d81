"""From a dataset file to samples: rows in any supported format (:mod:`.dataformats`), parsed
and validated (:mod:`.dataset`), rendered and tokenized with their loss masks (:mod:`.chat`),
fed to the daemon by a thread (:mod:`.feeder`)."""
