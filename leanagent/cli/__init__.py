"""`leanagent ...`: the command line, a command or a group of commands per module, each parser beside its handler.

`data` (validate, curriculum, examples, demo-data), `model` (init-model, export), `jobs` (train, fisher, evaluate),
`run` (run, status, cancel), `report`, `retrieval` (index, retrieve), `serve`, `bench`; `common` holds the one way
to refuse (`CommandError`) and the exit codes; `main` builds the parser and turns a refusal into one line.
"""

from leanagent.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
