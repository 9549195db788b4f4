"""The controller's floors, top floor first (held by tests/unit/test_floors.py, listed by
scripts/docs in docs/generated/floors.md). Packages on one floor are siblings: neither imports the
other."""

FLOORS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("deployment",),
    ("engine",),
    ("store", "gateways"),
    ("rules",),
    ("agent", "sandbox"),
    ("connectors", "lxd"),
    ("config",),
    ("results", "errors"),
)
