"""Bounds every input is held to, wherever it comes from (a playbook, an inventory, the command
line, the library's options): a number past them is a typo, a name past them is not a name."""

from __future__ import annotations

import re

MAX_SECONDS = 7 * 24 * 3600.0  # the longest wait any setting may ask for
MAX_COUNT = 1_000_000  # hosts, forks, rows: past this a number is a typo (and SQLite's limit is 2**63)
# A release's name: a directory under releases/ on every host.
RELEASE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
RELEASE_ID_RULE = "a release id is 1 to 128 of letters, digits, '.', '_' and '-', not starting with '.'"
