"""The `optimus` subcommands, one module each: its options, its parser and its `main`, which optimus.cli routes to.

The library never imports them: a command reads its arguments and calls the library's functions, which take
values, not argv.
"""
