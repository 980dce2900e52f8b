"""The `mpt` commands, one module each (``train``, ``plan``, ``simulate``, ``export``), each with
``run(args, argv, main) -> exit code``. `mp_toolkit.cli` imports a command's module only when that
command runs, so ``mpt --help`` imports neither torch nor any of the library."""
