"""Local sandboxes: real test hosts on this machine for the demo and the integration tests.

- ``ssh``: OpenSSH servers in network namespaces, each with its own /srv and /root.
"""
