"""The dump area, the daemon's side: reading dumps back (:mod:`.format`) and seeing them
arrive (:mod:`.watcher`). The writing side is :mod:`eagle3d.remote.dumpfile`."""
