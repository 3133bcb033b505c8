"""The `edgemoe` commands, one module each (run.py is `edgemoe run`); edgemoe/cli.py gathers them
into the command line. Options several commands take are defined once, in options.py; the options
that cannot act where they are given are refused from one table, cannot_act.py.

A command module imports only light modules at its top and the library inside its command:
`edgemoe --help` and a bad flag answer without loading torch and numba, which take seconds
(docs/benchmarks.md, "Command start-up")."""
