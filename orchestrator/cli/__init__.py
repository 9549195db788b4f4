"""``orchestrate``: parsing, dispatch and exit codes (``main``) over the library; everything it
prints is rendered by ``render``."""

from orchestrator.cli.main import entry

__all__ = ["entry"]
