"""Subcommands of ``tpplan``: each module has ``register(subparsers)`` setting ``run``."""
