"""Subcommands of the ``lpsync`` console script; each exposes add_parser() and run()."""
