"""The other subcommands of ``eagle3d`` and their helpers: ``verify``, ``demo``,
``tiny-model``, ``unit``, ``serve-sglang`` / ``sglang-args``, and the logging set-up."""
