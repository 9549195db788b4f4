"""Side by side: orchestrate deploy vs Ansible vs plain Fabric vs the floor, on the same work and
the same hosts, then watch rounds, and a served fleet's deploy, verify and watch.

The work, per host: push a ~2 KB drafter config with checksum verification and an atomic rename,
read it back and compare its sha256, run one command. Before the repetitions, the "first deploy"
of each N: orchestrate on hosts that never ran its agent, which compiles it there once. Then, in
each repetition, first run: the file changes; second run: no change; each run also an
``orchestrate verify`` of it (the "verify" tool). Each tool, each N, in
alternation, median of --reps runs: wall seconds, the tool's CPU (its process and children) a
host, its peak memory, and SSH connections and execs (exec + sftp requests) a host counted from
the hosts' own sshd logs at DEBUG1.

Unless --watch-rounds 0: a watch of the files-only release (bench/watch.py, a process of its own:
its first round, its median round over kept sessions, a second of holding them), then every host
serves a lean stand-in server (/health, completions and vLLM's spec-decode counters; a thousand
real vLLMs do not fit on one machine): a deploy of that release, a verify, a watch, a stop. The
served phase runs only where the machine's memory holds that many served hosts (about 12 MiB
each: the server, the agent, the sshd session); else it says why and goes on. Needs root (it
brings up the ssh sandbox).

    python bench/run.py --hosts 8,32,128,512,1024 --reps 1 --tools orchestrate,verify,floor,fabric
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
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from orchestrator.sandbox.sshhosts import SshSandbox

REPO = Path(__file__).resolve().parents[1]
DRAFTER = REPO / "playbooks" / "files" / "qwen36-27b-dflash" / "config.json"
ROOT = "/srv/bench"
FABRIC_SCRIPT = Path(__file__).resolve().parent / "fabric_push.py"
FLOOR_SCRIPT = Path(__file__).resolve().parent / "floor.py"
WATCH_SCRIPT = Path(__file__).resolve().parent / "watch.py"
STANDIN = REPO / "tests" / "unit" / "standin_vllm.py"


@dataclass
class Sample:
    wall: float
    cpu: float  # the tool's processes, seconds
    trips: float  # exec and sftp requests a host
    machine: float
    peak_mib: float = 0.0  # the tool's largest process
    conns: float = 0.0  # SSH connections a host


@dataclass
class Counted:
    """What the hosts' sshds saw so far: connections and requests."""

    conns: int
    trips: int


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


def count_requests(box: SshSandbox, names: list[str]) -> Counted:
    """Connections, and exec and sftp requests, seen by these hosts' sshds so far."""
    conns = trips = 0
    for name in names:
        log = Path(box.dir / "hosts" / name / "sshd.log").read_text(errors="replace")
        for line in log.splitlines():
            trips += line.endswith((" req exec", " req subsystem"))
            conns += "Accepted publickey" in line
    return Counted(conns, trips)


def forget_agent(box: SshSandbox, names: list[str]) -> None:
    """Each host as before its first deploy: no compiled agent in its cache."""
    chosen = set(names)
    for h in box.hosts():
        if h.name in chosen:
            shutil.rmtree(Path(h.files) / "root" / ".cache" / "dflash-orchestrator", ignore_errors=True)


def config_bytes(rep: int) -> bytes:
    data = json.loads(DRAFTER.read_text())
    data["bench"] = {"rep": rep, "padding": "x" * 600}  # about 2 KB
    return (json.dumps(data, indent=2) + "\n").encode()


def write_inputs(work: Path, box: SshSandbox, names: list[str], content: bytes, forks: int) -> None:
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
                "forks": forks,
            }
        )
    )


def tool_argv(tool: str, forks: int, venv: Path) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_NOCOLOR="1", ORCHESTRATE_STATE_DIR="state")
    orchestrate = [str(venv / "orchestrate")]
    if tool in ("orchestrate", "verify"):
        step = "deploy" if tool == "orchestrate" else "verify"
        return [*orchestrate, step, "pb.yaml", "-i", "inventory.yaml", "--forks", str(forks)], env
    if tool.startswith("ansible"):
        env["ANSIBLE_PIPELINING"] = "True" if tool.endswith("pipelining") else "False"
        return [str(venv / "ansible-playbook"), "-i", "hosts.ini", "-f", str(forks), "ansible.yaml"], env
    if tool == "floor":
        return [str(venv / "python"), str(FLOOR_SCRIPT), "hosts.json"], env
    return [str(venv / "python"), str(FABRIC_SCRIPT), "hosts.json"], env


def run(argv: list[str], cwd: Path, env: dict[str, str], what: str) -> tuple[str, float, float]:
    """Run a tool to its end: its stdout, its CPU seconds and its peak memory (MiB), both from the
    kernel's accounting of that process and the children it waited for."""
    with open(cwd / "out.txt", "w+") as out, open(cwd / "err.txt", "w+") as err:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return stdout, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def measure(
    box: SshSandbox, names: list[str], argv: list[str], cwd: Path, env: dict[str, str], what: str
) -> tuple[Sample, str]:
    before, busy = count_requests(box, names), machine_busy()
    start = time.perf_counter()
    stdout, cpu, peak = run(argv, cwd, env, what)
    wall, busy = time.perf_counter() - start, machine_busy() - busy
    after, n = count_requests(box, names), len(names)
    sample = Sample(wall, cpu, (after.trips - before.trips) / n, busy, peak, (after.conns - before.conns) / n)
    print(
        f"N={n} {what:<28} {wall:7.2f} s wall {cpu:6.2f} s cpu {peak:6.0f} MiB"
        f" {sample.conns:4.1f} conns/host {sample.trips:4.1f} execs/host",
        file=sys.stderr,
    )
    return sample, stdout


def write_served(work: Path, inventory: Path, start_delay: float) -> None:
    """A release every host serves: the stand-in server in its lean form (one thread, the socket
    module alone, ``python3 -S``: about 7 MiB a host against 12 with http.server)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "target").mkdir(exist_ok=True)
    target = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64}
    target |= {"num_hidden_layers": 2, "vocab_size": 64, "layer_types": ["full_attention"] * 2}
    (work / "target" / "config.json").write_text(json.dumps(target))
    drafter = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8}
    drafter |= {"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1]}, "hidden_size": 64}
    drafter |= {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}
    drafter |= {"vocab_size": 64, "num_target_layers": 2, "layer_types": ["full_attention"]}
    (work / "drafter.json").write_text(json.dumps(drafter, indent=2))
    # The hosts see /tmp but not every path of this machine: the stand-in and the system Python.
    shutil.copyfile(STANDIN, work / STANDIN.name)
    python = work / "python"
    python.write_text(f'#!/bin/sh\nexec /usr/bin/python3 -S {work / STANDIN.name} "$@"\n')
    python.chmod(0o755)
    book = {
        "name": "bench-served",
        "targets": ["all"],
        "deploy_root": "/srv/bench-served",
        "drafter": {"config": "drafter.json", "target_config": "target/config.json"},
        "serving": {
            "python": str(python),
            "target": str(work / "target"),
            "model_name": "tiny",
            "num_speculative_tokens": 7,
            "port": 8000,
            "startup_timeout": 300,
            "env": {"STANDIN_GOOD_MASK": "5", "STANDIN_LEAN": "1", "STANDIN_START_DELAY": str(start_delay)},
        },
        "gates": {"acceptance": {"min_mean_acceptance_length": 4.0, "min_drafts": 10, "max_tokens": 32}},
    }
    (work / "pb.yaml").write_text(json.dumps(book))
    shutil.copyfile(inventory, work / "inventory.yaml")


def served(
    box: SshSandbox, names: list[str], work: Path, venv: Path, forks: int, rounds: int, start_delay: float
) -> dict[str, Sample]:
    """Deploy a served release to every host, verify it, watch it --watch-rounds rounds, stop it."""
    write_served(work, work.parent / "inventory.yaml", start_delay)
    env = dict(os.environ, ORCHESTRATE_STATE_DIR="state")
    orchestrate = [str(venv / "orchestrate")]
    args = ["pb.yaml", "-i", "inventory.yaml", "--forks", str(forks)]
    out: dict[str, Sample] = {}
    out["deploy"], _ = measure(box, names, [*orchestrate, "deploy", *args], work, env, "served deploy")
    out["verify"], _ = measure(box, names, [*orchestrate, "verify", *args], work, env, "served verify")
    out |= watch(box, names, work, venv, forks, rounds, "served watch")
    run([*orchestrate, "stop", *args], work, env, "served stop")
    return out


def watch(
    box: SshSandbox, names: list[str], work: Path, venv: Path, forks: int, rounds: int, what: str
) -> dict[str, Sample]:
    """Watch rounds of the playbook in ``work`` (bench/watch.py, a process of its own): the first
    round, the median later round, and a second of holding the sessions between rounds."""
    env = dict(os.environ, ORCHESTRATE_STATE_DIR="state")
    argv = [str(venv / "python"), str(WATCH_SCRIPT), "pb.yaml", "inventory.yaml"]
    whole, stdout = measure(box, names, [*argv, "--rounds", str(rounds), "--forks", str(forks)], work, env, what)
    seen = json.loads(stdout)
    if seen["states"] != ["READY"] or seen["sessions"] != len(names):
        raise SystemExit(f"the watch saw {seen['states']} with {seen['sessions']} sessions of {len(names)}")
    print(f"N={len(names)} {what}: {seen}", file=sys.stderr)
    return {
        # The first round: connections and agents started (the process's whole count of each).
        "watch (first round)": replace(whole, wall=seen["first_round_s"], cpu=0.0, machine=0.0),
        "watch round": Sample(seen["round_s"], seen["round_cpu_s"], 0.0, 0.0, seen["peak_mib"], 0.0),
        # Holding the sessions between rounds, a second of it: a round every 30 s costs 30 of these.
        "watch, idle second": Sample(1.0, seen["idle_cpu_s_a_second"], 0.0, 0.0, seen["peak_mib"], 0.0),
    }


def available_kib() -> int:
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    return int(next(line.split()[1] for line in meminfo if line.startswith("MemAvailable:")))


class ServedMemory:
    """What a served host under watch takes of this machine's memory (its server, its agent, its
    sshd session), measured on each served phase; before the first, what 512 hosts took here
    (12.4 MiB) and some."""

    def __init__(self) -> None:
        self.kib_a_host = 16 * 1024
        self.low = 0
        self._stop = threading.Event()

    def __enter__(self) -> ServedMemory:
        self.start, self.low = available_kib(), available_kib()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            self.low = min(self.low, available_kib())

    def measured(self, n: int) -> None:
        self._stop.set()
        self._thread.join()
        self.kib_a_host = max(self.kib_a_host if n < 64 else 0, (self.start - self.low) // n)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def no_room(self, n: int) -> str | None:
        """Why this machine cannot hold N served hosts under watch, or None: past its memory the
        kernel ends processes at random (the watcher among them)."""
        need, available = int(n * self.kib_a_host * 1.15) + (1 << 20), available_kib()  # 15 % and 1 GiB to spare
        if available >= need:
            return None
        return (
            f"{n} served hosts need about {need / (1 << 20):.1f} GiB ({self.kib_a_host / 1024:.1f} MiB a host),"
            f" {available / (1 << 20):.1f} GiB is available"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="8,32,128")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--tools",
        default="orchestrate,verify,floor,ansible,ansible-pipelining,fabric",
        help="orchestrate: deploy; verify: orchestrate verify; floor: bare paramiko, connect + one exec + close a host (bench/floor.py)",
    )
    parser.add_argument("--forks", default="hosts", help="hosts worked on at once by every tool (default: all of them)")
    parser.add_argument("--watch-rounds", type=int, default=10, help="rounds of the served watch (0: no served phase)")
    parser.add_argument(
        "--start-delay",
        type=float,
        default=0.0,
        help="seconds each served host's server takes to listen, as a model loads (default 0)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--sandbox",
        nargs=3,
        metavar=("DIR", "PREFIX", "SUBNET"),
        default=["/var/lib/dflash-orchestrator/bench-sandbox", "dfb", "10.81"],
        help="the ssh sandbox's directory, name prefix and /16 (another than the default's, to run beside it)",
    )
    args = parser.parse_args()
    sizes = [int(x) for x in args.hosts.split(",")]
    tools = args.tools.split(",")
    venv = Path(sys.executable).parent
    # The tool as installed: pip compiles a package's bytecode when it installs it, while an
    # editable checkout run with PYTHONDONTWRITEBYTECODE set compiles every module on every start.
    for package in ("orchestrator", "remote_agent"):
        compileall.compile_dir(REPO / package, quiet=1)
    sandbox_dir, prefix, subnet = args.sandbox
    box = SshSandbox(Path(sandbox_dir), prefix=prefix, subnet=subnet, log_level="DEBUG1")
    box.down()
    box.up(max(sizes))
    for h in box.hosts():  # the destination directories exist beforehand, for every tool alike
        for tool_dir in ("ansible", "fabric"):
            (Path(h.files) / "srv" / "bench" / tool_dir).mkdir(parents=True, exist_ok=True)
    work = Path(f"/tmp/orchestrate-bench-{prefix}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    results: dict[tuple[int, str, str], list[Sample]] = {}
    memory = ServedMemory()
    failed: SystemExit | None = None
    try:
        for n in sizes:
            forks = n if args.forks == "hosts" else int(args.forks)
            names = [h.name for h in box.hosts()[:n]]
            inv = box.inventory.read_text().split("    containers:\n")[0] + "    containers:\n"
            inv += "".join(f"      {h.name}:\n        address: {h.address}\n" for h in box.hosts()[:n])
            (work / "inventory.yaml").write_text(
                inv.replace("key: id_ed25519", f"key: {box.client_key}").replace(
                    "known_hosts: known_hosts", f"known_hosts: {box.known_hosts}"
                )
            )
            if "orchestrate" in tools:
                # A host's first deploy ever compiles the agent there (kept in its ~/.cache): a cost
                # paid once per host, reported apart so that the repetitions measure the steady state.
                forget_agent(box, names)
                write_inputs(work, box, names, config_bytes(-1 - 1000 * n), forks)
                argv, env = tool_argv("orchestrate", forks, venv)
                sample, _ = measure(box, names, argv, work, env, "first deploy orchestrate")
                results[(n, "orchestrate", "first deploy")] = [sample]
            for rep in range(args.reps):
                write_inputs(work, box, names, config_bytes(rep + 1000 * n), forks)
                for run_ in ("change", "no change"):
                    for tool in tools:
                        argv, env = tool_argv(tool, forks, venv)
                        sample, _ = measure(box, names, argv, work, env, f"rep={rep} {run_} {tool}")
                        results.setdefault((n, tool, run_), []).append(sample)
            if args.watch_rounds and "orchestrate" in tools:  # the watch is of what the deploy put
                # The files-only release under watch: a round's files and READY record, no server.
                for step, sample in watch(box, names, work, venv, forks, args.watch_rounds, "watch").items():
                    results[(n, step, "no change")] = [sample]
                why = memory.no_room(n)
                if why is not None:
                    print(f"N={n}: no served phase: {why}", file=sys.stderr)
                    continue
                with memory:
                    steps = served(box, names, work / "served", venv, forks, args.watch_rounds, args.start_delay)
                    memory.measured(n)
                print(f"N={n}: a served host under watch took {memory.kib_a_host / 1024:.1f} MiB", file=sys.stderr)
                for step, sample in steps.items():
                    results[(n, step, "served")] = [sample]
    except SystemExit as exc:
        failed = exc  # a tool failed: what finished before it is still reported
    finally:
        box.down()
    rows = table(results, [n for n in sizes if any(key[0] == n for key in results)])
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        print_table(rows)
    if failed is not None:
        raise failed


def table(results: dict[tuple[int, str, str], list[Sample]], sizes: list[int]) -> list[dict[str, object]]:
    """One row per hosts, run and tool: the medians, held to the floor and to Ansible and Fabric of
    the same run (a served step: to those of the no-change run)."""
    rows: list[dict[str, object]] = []
    for n in sizes:
        med = {
            (tool, run_): Sample(
                *(statistics.median(getattr(s, f) for s in samples) for f in Sample.__dataclass_fields__)
            )
            for (size, tool, run_), samples in results.items()
            if size == n
        }
        for (tool, run_), sample in med.items():
            same = {"served": "no change", "first deploy": "change"}.get(run_, run_)
            ratio = {}
            for other in ("floor", "ansible", "fabric"):
                # A served step or a watch round is held to the floor alone; a second of holding
                # sessions to nothing.
                alone = run_ == "served" or tool.startswith("watch")
                comparable = tool != "watch, idle second" and (other == "floor" or not alone)
                base = med.get((other, same)) if comparable else None
                ratio[other] = round(sample.wall / base.wall, 3) if base else None
            rows.append(
                {"hosts": n, "run": run_, "tool": tool, **asdict(sample), "cpu_ms_a_host": 1000 * sample.cpu / n}
                | {f"x_{other}": value for other, value in ratio.items()}
            )
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    print(
        "| hosts | run | tool | wall s | x floor | CPU a host | peak memory | connections a host | execs a host | x Ansible | x Fabric | machine CPU |"
    )
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def x(r: dict[str, object], key: str) -> str:
        value = r[key]
        return f"{value:.2f}" if isinstance(value, float) else "-"

    for r in rows:
        print(
            f"| {r['hosts']} | {r['run']} | {r['tool']} | {r['wall']:.3f} | {x(r, 'x_floor')} | {r['cpu_ms_a_host']:.2f} ms"
            f" | {r['peak_mib']:.0f} MiB | {r['conns']:.1f} | {r['trips']:.1f} | {x(r, 'x_ansible')} | {x(r, 'x_fabric')} | {r['machine']:.1f} s |"
        )


if __name__ == "__main__":
    main()
