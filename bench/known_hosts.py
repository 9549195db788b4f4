"""What checking host keys costs a run as the fleet grows, with a hashed known_hosts (what
``ssh-keyscan -H`` writes, and OpenSSH's HashKnownHosts, Debian's default): a hashed name is found
only by hashing each name looked up with every entry's salt, N*N HMACs for N hosts. Per N: the
CPU seconds of reading the file and of what a connection to each host asks of it (the key type to
ask for, then the check of the key offered).

    python bench/known_hosts.py --hosts 128,512,1024,4096
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import os
import subprocess
import tempfile
import time
from pathlib import Path

import paramiko

from orchestrator.connectors.ssh import KnownHosts


def hashed(name: str) -> str:
    salt = os.urandom(20)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="128,512,1024,4096")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{tmp}/k"], check=True)
        key = paramiko.Ed25519Key.from_private_key_file(f"{tmp}/k")
        print("| hosts | read | the run's lookups | a host |")
        print("| ---: | ---: | ---: | ---: |")
        for n in map(int, args.hosts.split(",")):
            names = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(n)]
            path = Path(tmp) / f"known_hosts.{n}"
            path.write_text("".join(f"{hashed(name)} ssh-ed25519 {key.get_base64()}\n" for name in names))
            start = time.process_time()
            table = KnownHosts(path)
            read = time.process_time() - start
            start = time.process_time()
            for name in names:
                assert table.preferred_type(name) == "ssh-ed25519"
                table.check(name, name, key, accept_new=False)
            lookups = time.process_time() - start
            print(f"| {n} | {read:.3f} s | {lookups:.3f} s | {1000 * lookups / n:.2f} ms |", flush=True)


if __name__ == "__main__":
    main()
