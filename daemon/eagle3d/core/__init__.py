"""The pure core: what the daemon knows about each sample, and the rules it follows.

Nothing here does I/O, starts a thread or touches asyncio, and time is an argument. The
:class:`~eagle3d.core.ledger.Ledger` owns the per-sample state and answers every event with
effects (:mod:`eagle3d.core.effects`) that the imperative shell (:mod:`eagle3d.run`) carries
out; :mod:`eagle3d.core.envfault` judges whose fault a failure is; :mod:`eagle3d.core.resume`
folds a replayed journal into the status the ledger starts from.
"""
