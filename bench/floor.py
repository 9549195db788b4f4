"""The floor a deploy is held to: bare paramiko, per host connect (host keys checked strictly, as
every tool here does), one exec of the hosts' Python (``python3 -c pass``: the interpreter start
our agent also pays) and close, all hosts at once on threads, as ``--forks N`` runs them. Nothing
is pushed or verified: no tool can do less and still reach each host."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import paramiko


def reach(host: str, key: str, known_hosts: str) -> None:
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.load_host_keys(known_hosts)
    client.connect(host, username="root", key_filename=key, look_for_keys=False, allow_agent=False, timeout=60)
    try:
        _, out, _ = client.exec_command("/usr/bin/python3 -c pass")
        if out.channel.recv_exit_status() != 0:
            raise SystemExit(f"{host}: the exec failed")
    finally:
        client.close()


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    with ThreadPoolExecutor(max_workers=len(spec["hosts"])) as pool:
        list(pool.map(lambda h: reach(h, spec["key"], spec["known_hosts"]), spec["hosts"]))


if __name__ == "__main__":
    main(sys.argv[1])
