"""eagle3-top: the monitor for eagle3d runs (Textual TUI, ``--once`` text/JSON, ssh relay).

Heavy modules load lazily: ``--once`` touches :mod:`.cli`, :mod:`.sources`, :mod:`.once`,
:mod:`.report`, :mod:`.fmt` and :mod:`.model` only; Textual is imported by :mod:`.app`.
"""
