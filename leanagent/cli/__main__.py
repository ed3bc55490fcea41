"""`python -m leanagent.cli ...`: the same as the `leanagent` command."""

from leanagent.cli.main import main

main()
