"""How a command reaches a host: the seam (``base``), the router that picks a connector per target
(``router``), and the connectors themselves: ``ssh`` (the only paramiko importer), ``local`` and
``fake`` (in memory, for tests)."""
