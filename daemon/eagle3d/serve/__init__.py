"""What the daemon tells the world while it runs: the event socket (:mod:`.server`), systemd
(:mod:`.notify`), stats records (:mod:`.telemetry`) and the terminal's progress line
(:mod:`.progress`)."""
