"""The same work with plain Fabric (ThreadingGroup), as a typical team would write it.

Per host: SFTP the file to a temp name, check its sha256, rename it over the final path, read the
final path's sha256 back and compare, run one command. Host keys are checked strictly against the
sandbox's known_hosts (RejectPolicy), as our tool does.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import paramiko
from fabric import Connection, ThreadingGroup


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    connections = []
    for host in spec["hosts"]:
        c = Connection(host, user="root", connect_kwargs={"key_filename": spec["key"], "look_for_keys": False})
        c.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        c.client.load_host_keys(spec["known_hosts"])
        connections.append(c)
    group = ThreadingGroup.from_connections(connections)
    dest, tmp = spec["dest"], spec["dest"] + ".tmp"
    with ThreadPoolExecutor(max_workers=len(connections)) as pool:  # Group has no put: thread it ourselves
        list(pool.map(lambda c: c.put(spec["src"], tmp), connections))
    group.run(f"test \"$(sha256sum {tmp} | cut -d' ' -f1)\" = {spec['digest']} && mv {tmp} {dest}", hide=True)
    results = group.run(f"sha256sum {dest} && /usr/bin/python3 --version", hide=True)
    for result in results.values():
        if result.stdout.split()[0] != spec["digest"]:
            raise SystemExit(f"{result.connection.host}: read-back differs")
    group.close()


if __name__ == "__main__":
    main(sys.argv[1])
