"""Local sandboxes: real test hosts on this machine for the demo and the integration tests.

- ``ssh``: OpenSSH servers in network namespaces, each with its own /srv and /root.
- ``lxd``: real LXD containers behind a GPU-host sshd (the jump host).

This module stays light: the CLI reads DEFAULT_DIR on every start and imports the sandboxes
only for ``orchestrate sandbox``.
"""

import os
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("ORCHESTRATE_SANDBOX_DIR", "/var/lib/dflash-orchestrator/sandbox"))
