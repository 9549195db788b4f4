"""`python -m orchestrator`: the same CLI as the `orchestrate` console script."""

from orchestrator.cli.main import entry

entry()
