"""Side by side: orchestrate deploy vs Ansible vs plain Fabric, on the same work and the same hosts.

The work, per host: push a ~2 KB drafter config with checksum verification and an atomic rename,
read it back and compare its sha256, run one command. First run: the file changes; second run: no
change. Each tool, each N, in alternation, median of --reps runs: wall seconds, controller CPU
seconds (this process's children), and SSH round trips per host (exec + sftp requests counted from
the hosts' own sshd logs at DEBUG1). Needs root (it brings up the ssh sandbox).

    python bench/run.py --hosts 8,32,128 --reps 3
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.sandbox.sshhosts import SshSandbox

REPO = Path(__file__).resolve().parents[1]
DRAFTER = REPO / "playbooks" / "files" / "qwen36-27b-dflash" / "config.json"
ROOT = "/srv/bench"
FABRIC_SCRIPT = Path(__file__).resolve().parent / "fabric_push.py"
FLOOR_SCRIPT = Path(__file__).resolve().parent / "floor.py"


@dataclass
class Sample:
    wall: float
    cpu: float
    trips: float
    machine: float


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy: the controller, sshd and the hosts' processes.

    With every host on this machine's cores, the hosts' own work turns into wall time for every
    tool alike; this column shows how much of it each tool causes.
    """
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def count_requests(box: SshSandbox, names: list[str]) -> int:
    """exec and sftp requests seen by these hosts' sshds so far."""
    total = 0
    for name in names:
        log = Path(box.dir / "hosts" / name / "sshd.log").read_text(errors="replace")
        total += sum(1 for line in log.splitlines() if line.endswith((" req exec", " req subsystem")))
    return total


def config_bytes(rep: int) -> bytes:
    data = json.loads(DRAFTER.read_text())
    data["bench"] = {"rep": rep, "padding": "x" * 600}  # about 2 KB
    return (json.dumps(data, indent=2) + "\n").encode()


def write_inputs(work: Path, box: SshSandbox, names: list[str], content: bytes) -> None:
    (work / "config.json").write_bytes(content)
    (work / "pb.yaml").write_text(
        f"name: bench\ntargets: [all]\ndeploy_root: {ROOT}\ndrafter: {{config: config.json}}\n"
    )
    addresses = {h.name: h.address for h in box.hosts()}
    inv = ["[bench]"] + [f"{n} ansible_host={addresses[n]}" for n in names]
    inv += [
        "[bench:vars]",
        "ansible_user=root",
        f"ansible_ssh_private_key_file={box.client_key}",
        f"ansible_ssh_common_args='-o UserKnownHostsFile={box.known_hosts} -o StrictHostKeyChecking=yes'",
        "ansible_python_interpreter=/usr/bin/python3",
    ]
    (work / "hosts.ini").write_text("\n".join(inv) + "\n")
    digest = subprocess.run(["sha256sum", str(work / "config.json")], capture_output=True, text=True).stdout.split()[0]
    (work / "ansible.yaml").write_text(
        f"""- hosts: bench
  gather_facts: false
  tasks:
    - name: push the drafter config (atomic, validated)
      copy: {{src: {work / "config.json"}, dest: {ROOT}/ansible/config.json, validate: "/usr/bin/python3 -m json.tool %s"}}
    - name: read it back
      slurp: {{src: {ROOT}/ansible/config.json}}
      register: back
    - name: compare sha256
      assert: {{that: "(back.content | b64decode | hash('sha256')) == '{digest}'"}}
    - name: run one command
      command: /usr/bin/python3 --version
"""
    )
    (work / "hosts.json").write_text(
        json.dumps(
            {
                "hosts": [addresses[n] for n in names],
                "key": str(box.client_key),
                "known_hosts": str(box.known_hosts),
                "digest": digest,
                "src": str(work / "config.json"),
                "dest": f"{ROOT}/fabric/config.json",
            }
        )
    )


def run_tool(tool: str, work: Path, n: int, venv: Path) -> None:
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_NOCOLOR="1")
    if tool == "orchestrate":
        argv = [str(venv / "orchestrate"), "deploy", "pb.yaml", "-i", "inventory.yaml", "--forks", str(n)]
        env["ORCHESTRATE_STATE_DIR"] = str(work / "state")
    elif tool.startswith("ansible"):
        env["ANSIBLE_PIPELINING"] = "True" if tool.endswith("pipelining") else "False"
        argv = [str(venv / "ansible-playbook"), "-i", "hosts.ini", "-f", str(n), "ansible.yaml"]
    elif tool == "floor":
        argv = [str(venv / "python"), str(FLOOR_SCRIPT), "hosts.json"]
    else:
        argv = [str(venv / "python"), str(FABRIC_SCRIPT), "hosts.json"]
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="8,32,128")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--tools",
        default="orchestrate,floor,ansible,ansible-pipelining,fabric",
        help="floor: bare paramiko, connect + one exec + close a host (bench/floor.py)",
    )
    args = parser.parse_args()
    sizes = [int(x) for x in args.hosts.split(",")]
    tools = args.tools.split(",")
    venv = Path(sys.executable).parent
    # The tool as installed: pip compiles a package's bytecode when it installs it, while an
    # editable checkout run with PYTHONDONTWRITEBYTECODE set compiles every module on every start.
    for package in ("orchestrator", "remote_agent"):
        compileall.compile_dir(REPO / package, quiet=1)
    box = SshSandbox(
        Path("/var/lib/dflash-orchestrator/bench-sandbox"), prefix="dfb", subnet="10.81", log_level="DEBUG1"
    )
    box.down()
    box.up(max(sizes))
    for h in box.hosts():  # the destination directories exist beforehand, for every tool alike
        for tool_dir in ("ansible", "fabric"):
            (Path(h.files) / "srv" / "bench" / tool_dir).mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/orchestrate-bench")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    results: dict[tuple[int, str, str], list[Sample]] = {}
    try:
        for n in sizes:
            names = [h.name for h in box.hosts()[:n]]
            inv = box.inventory.read_text().split("    containers:\n")[0] + "    containers:\n"
            inv += "".join(f"      {h.name}:\n        address: {h.address}\n" for h in box.hosts()[:n])
            (work / "inventory.yaml").write_text(
                inv.replace("key: id_ed25519", f"key: {box.client_key}").replace(
                    "known_hosts: known_hosts", f"known_hosts: {box.known_hosts}"
                )
            )
            for rep in range(args.reps):
                write_inputs(work, box, names, config_bytes(rep + 1000 * n))
                for run in ("first", "second"):
                    for tool in tools:
                        trips, cpu, busy = count_requests(box, names), children_cpu(), machine_busy()
                        start = time.perf_counter()
                        run_tool(tool, work, n, venv)
                        wall, busy = time.perf_counter() - start, machine_busy() - busy
                        sample = Sample(wall, children_cpu() - cpu, (count_requests(box, names) - trips) / n, busy)
                        results.setdefault((n, tool, run), []).append(sample)
                        print(
                            f"N={n} rep={rep} {run:<6} {tool:<20} {sample.wall:6.2f} s wall {sample.cpu:6.2f} s cpu {sample.trips:4.1f} trips/host",
                            file=sys.stderr,
                        )
    finally:
        box.down()
    print_table(results, sizes, tools)


def print_table(results: dict[tuple[int, str, str], list[Sample]], sizes: list[int], tools: list[str]) -> None:
    print(
        f"{'N':>4} {'run':<7} {'tool':<20} {'wall s':>8} {'cpu s':>7} {'trips/host':>10} {'x floor':>8}"
        f" {'x ansible':>10} {'x fabric':>9} {'machine cpu s':>14}"
    )
    for n in sizes:
        for run in ("first", "second"):
            med = {
                t: Sample(
                    *(
                        statistics.median(getattr(s, f) for s in results[(n, t, run)])
                        for f in ("wall", "cpu", "trips", "machine")
                    )
                )
                for t in tools
            }
            for t in tools:
                ans, fab, flo = med.get("ansible"), med.get("fabric"), med.get("floor")
                rel_a = f"{med[t].wall / ans.wall:.3f}" if ans else "-"
                rel_f = f"{med[t].wall / fab.wall:.3f}" if fab else "-"
                rel_0 = f"{med[t].wall / flo.wall:.2f}" if flo else "-"
                print(
                    f"{n:>4} {run:<7} {t:<20} {med[t].wall:8.2f} {med[t].cpu:7.2f} {med[t].trips:10.1f} {rel_0:>8}"
                    f" {rel_a:>10} {rel_f:>9} {med[t].machine:14.2f}"
                )


if __name__ == "__main__":
    main()
