"""The imperative shell of ``eagle3d run``: small pieces around the pure ledger, each owning
one concern (docs/architecture.md):

* :mod:`.daemon` - the lifecycle: preflight, lock, resume, start and stop order, signals;
* :mod:`.inbox` - the one way in: typed messages from every thread, handled on the loop;
* :mod:`.pipeline` - hands each message to the ledger and carries out the effects it answers;
* :mod:`.commits` - the commit scheduler, whose thread body returns typed outcomes;
* :mod:`.recorder` - the only path to the journal, from any thread, with one error policy;
* :mod:`.diskguard` - the output's identity, probe writes, free space, the journal's reserve;
* :mod:`.ticker` - the 1 s tick: timeouts, probes, stats, the watchdog, the progress line;
* :mod:`.preflight` and :mod:`.job` - what is checked and read before anything starts.
"""
