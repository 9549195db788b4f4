"""LXD: what a container should look like (``containers``, pure) and the only pylxd importer
(``host``)."""
