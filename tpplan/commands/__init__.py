"""The commands layer: one module per ``tpplan`` subcommand, argparse and printing only.

Each module has ``register(subparsers)`` and a ``run(args)`` that calls the layers below
(the façade, analysis, train, byom) and prints what they return; ``_common`` holds what
they share. Imported by :mod:`tpplan.cli`, never by the layers below.
"""
