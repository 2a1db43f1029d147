#!/usr/bin/env python
"""A real multi-host Ray cluster on one Linux machine, a training run across it, and a host failure.

Needs root (network namespaces). Each "host" is a network namespace with its own IP on a private
bridge (10.77.0.0/24 by default; the bridge lives in a namespace of its own, so nothing touches the
machine's own interfaces or firewall). One Ray node per host, started with this Python's `ray`:

  head     10.77.0.10  ray start --head      --resources '{"learner_host": 1}'    learner, buffer, controller
  gen-a    10.77.0.11  ray start --address   --resources '{"generator_host": 1}'  generator engine(s)
  gen-b    10.77.0.12  ray start --address   --resources '{"generator_host": 1}'  spare generator host

The run (`python -m async_rl.launch`, started in the head namespace) sets `ray.address`, binds the
buffer and the weight rendezvous on every interface (`buffer.host=0.0.0.0 weight_sync.host=0.0.0.0`:
peers get 10.77.0.10), and pins engines and learner to their hosts with `generators.ray_resources`
and `learner.ray_resources`. Weights go over gloo (the default on a cluster), trajectories and
batches over ZMQ with CURVE (the default). After step `--kill-after` the script SIGKILLs the raylet
of the host that runs the engine; the run replaces the engine on the spare host and finishes. With
`--generator-hosts 1` nothing can host the replacement: the run stops with one line.

Everything it made (namespaces, veth pairs, bridge, every process in its namespaces, by pid, and
Ray's temp folder) is removed on the way out, also on failure or Ctrl-C. Prints a JSON summary
(which host ran what, the cross-host connections seen, timings) and writes it to OUT/summary.json.

  sudo PYTHONPATH=$PWD .venv/bin/python scripts/multihost_demo.py --out /tmp/multihost
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY_PORT = 6379
# Ray notices a dead node within ~3 s instead of ~30 s (GCS health checks; set on the head).
FAST_FAILURE_DETECTION = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
# Process titles of our Ray actors (Ray names an actor's worker "ray::Class.method") and vLLM's.
ROLES = {
    "GeneratorEngine": "engine",
    "LearnerDriver": "learner",  # every learner backend runs under the one driver actor
    "ReplayBuffer": "buffer",
    "VLLM::EngineCore": "vllm engine core",
    "VLLM::Worker": "vllm worker",
    "async_rl.launch": "controller",
    "raylet": "raylet",
    "gcs_server": "gcs",
}


def sh(*cmd: str, check: bool = True) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def can_make_namespaces() -> str:
    """'' if this process can create a network namespace (tried for real), else why not."""
    name = f"arlprobe{os.getpid()}"
    try:
        res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "iproute2's `ip` is not installed"
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip() or res.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return ""


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    resources: dict[str, float]
    num_cpus: int


@dataclass
class Connection:
    """One established TCP connection between two hosts, with the process on each end."""

    src_host: str
    src: str
    src_role: str
    dst_host: str
    dst: str
    dst_role: str


class NetnsCluster:
    """Namespaces + veths on a bridge + one Ray node each. `down()` removes every trace."""

    def __init__(self, prefix: str, subnet: str, generator_hosts: int, temp_dir: Path) -> None:
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.temp_dir = temp_dir
        self.hosts = [Host("head", f"{prefix}-head", f"{subnet}.10", {"learner_host": 1}, 1)]
        for i in range(generator_hosts):
            name = f"gen-{chr(ord('a') + i)}"
            self.hosts.append(Host(name, f"{prefix}-{name}", f"{subnet}.{11 + i}", {"generator_host": 1}, 1))
        self._made: list[str] = []  # namespaces created, for down()

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{RAY_PORT}"

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def in_ns(self, host: Host, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", host.ns, *cmd]

    def up(self) -> None:
        sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts):
            sh("ip", "netns", "add", h.ns)
            self._made.append(h.ns)
            # veth names: at most 15 characters; made in the root namespace, then moved at once.
            a, b = f"{self.prefix}h{i}", f"{self.prefix}s{i}"
            sh("ip", "link", "add", a, "netns", h.ns, "type", "veth", "peer", "name", b, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", b, "master", "br0", "up")
            sh("ip", "-n", h.ns, "link", "set", a, "name", "eth0")
            sh("ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            sh("ip", "-n", h.ns, "link", "set", "eth0", "up")
            sh("ip", "-n", h.ns, "link", "set", "lo", "up")
            # A default route (to nowhere beyond the bridge): Ray and vLLM find "this node's IP" by
            # asking the kernel which source address a packet to the internet would use.
            sh("ip", "-n", h.ns, "route", "add", "default", "dev", "eth0")
        env = {**self.env(), "RAY_USAGE_STATS_ENABLED": "0", **FAST_FAILURE_DETECTION}
        ray = str(Path(sys.executable).with_name("ray"))
        for h in self.hosts:
            common = [
                f"--node-ip-address={h.ip}",
                f"--num-cpus={h.num_cpus}",
                f"--resources={json.dumps(h.resources)}",
                "--object-store-memory=100000000",
                "--disable-usage-stats",
            ]
            if h is self.head:
                cmd = [
                    ray,
                    "start",
                    "--head",
                    f"--port={RAY_PORT}",
                    "--include-dashboard=false",
                    f"--temp-dir={self.temp_dir}",
                    *common,
                ]
            else:
                cmd = [ray, "start", f"--address={self.address}", *common]
            res = subprocess.run(self.in_ns(h, *cmd), env=env, capture_output=True, text=True, timeout=180)
            if res.returncode != 0:
                tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-1:]
                raise RuntimeError(f"ray start on {h.name} ({h.ip}) failed: {tail}")

    def env(self) -> dict[str, str]:
        """Environment of every Ray process and of the driver: this checkout, and Ray's token
        authentication with a token made for this cluster (every node and the driver need it)."""
        token = self.temp_dir / "auth_token"
        if not token.exists():
            token.write_text(secrets.token_hex(32))
            token.chmod(0o600)
        return {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
        }

    def pids(self, host: Host) -> list[int]:
        out = sh("ip", "netns", "pids", host.ns, check=False)
        return [int(p) for p in out.split()]

    def roles(self) -> dict[str, list[str]]:
        """Host name -> the roles of the processes running there (from their process titles)."""
        found: dict[str, list[str]] = {}
        for h in self.hosts:
            found[h.name] = sorted({role for pid in self.pids(h) if (role := role_of(pid))})
        return found

    def raylet_pid(self, host: Host) -> int | None:
        return next((pid for pid in self.pids(host) if comm(pid) == "raylet"), None)

    def connections(self) -> list[Connection]:
        """Established TCP connections from one host to another, each end named by its process."""
        ip_to_host = {h.ip: h.name for h in self.hosts}
        ends: dict[str, str] = {}  # "ip:port" -> role of the process that owns that end
        pairs: list[tuple[str, str, str]] = []
        for h in self.hosts:
            out = sh(*self.in_ns(h, "ss", "-tnpH", "state", "established"), check=False)
            for line in out.splitlines():
                parts = line.split()
                if len(parts) < 4:
                    continue
                local, peer = parts[2], parts[3]
                pid = _pid_in(line)
                ends[local] = (role_of(pid) or comm(pid)) if pid else "?"
                pairs.append((h.name, local, peer))
        seen = set()
        out: list[Connection] = []
        for src_host, local, peer in pairs:
            dst_host = ip_to_host.get(peer.rsplit(":", 1)[0])
            if dst_host is None or dst_host == src_host:
                continue
            key = tuple(sorted((local, peer)))
            if key in seen:
                continue
            seen.add(key)
            out.append(Connection(src_host, local, ends.get(local, "?"), dst_host, peer, ends.get(peer, "?")))
        return out

    def kill_host_processes(self, host: Host) -> None:
        # Ray may start a worker while we kill: repeat until the namespace is empty.
        for _ in range(20):
            pids = self.pids(host)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)

    def down(self) -> list[str]:
        """Remove everything up() made; returns what could not be removed (empty when clean)."""
        hosts = {h.ns: h for h in self.hosts}
        for ns in reversed(self._made):
            if ns in hosts:
                self.kill_host_processes(hosts[ns])
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return leftovers(self.prefix, self.temp_dir)


def leftovers(prefix: str, temp_dir: Path) -> list[str]:
    """Namespaces, interfaces or folders of this prefix still on the machine."""
    left = [
        ns.split()[0] for ns in sh("ip", "netns", "list", check=False).splitlines() if ns.startswith(prefix)
    ]
    left += [
        line.split(":")[1].strip().split("@")[0]
        for line in sh("ip", "-o", "link", check=False).splitlines()
        if line.split(":")[1].strip().startswith(prefix)
    ]
    if temp_dir.exists():
        left.append(str(temp_dir))
    return left


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def role_of(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
    name = comm(pid)
    for marker, role in ROLES.items():
        if marker in cmdline or name == marker:
            return role
    return ""


def _pid_in(ss_line: str) -> int | None:
    marker = "pid="
    i = ss_line.find(marker)
    if i < 0:
        return None
    digits = ss_line[i + len(marker) :].split(",", 1)[0]
    return int(digits) if digits.isdigit() else None


@dataclass
class Summary:
    hosts: dict[str, str]  # name -> IP
    launch_command: list[str]
    exit_code: int | None = None
    error_line: str = ""
    steps_done: int = 0
    cluster_up_s: float = 0.0
    run_s: float = 0.0
    killed_host: str = ""
    killed_raylet_pid: int = 0
    killed_after_step: int = 0
    roles_before_kill: dict[str, list[str]] = field(default_factory=dict)
    roles_after_recovery: dict[str, list[str]] = field(default_factory=dict)
    replaced_on: str = ""
    recovery_s: float = 0.0  # raylet killed -> the replacement engine ran a step
    engine_gone_s: float = -1.0  # raylet killed -> no engine process left on the killed host
    killed_host_left: list[str] = field(default_factory=list)  # its processes still alive when the run ended
    connections: list[Connection] = field(default_factory=list)
    recovery_events: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    total_s: float = 0.0


def engine_host(roles: dict[str, list[str]]) -> str:
    return next((h for h, r in roles.items() if "engine" in r), "")


def run_demo(args: argparse.Namespace) -> Summary:
    t0 = time.perf_counter()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "runs"
    prefix = f"arl{os.getpid() % 100000}"
    temp_dir = Path(tempfile.mkdtemp(prefix="arlmh-", dir="/tmp"))  # short: Ray's socket paths
    cluster = NetnsCluster(prefix, args.subnet, args.generator_hosts, temp_dir)
    launch = [
        sys.executable,
        "-m",
        "async_rl.launch",
        args.config,
        f"ray.address={cluster.address}",
        "buffer.host=0.0.0.0",
        "weight_sync.host=0.0.0.0",
        "weight_sync.backend=gloo",  # the default on a cluster; said here because these hosts share /dev/shm
        "weight_sync.timeout_s=30",
        "generators.ray_resources={generator_host: 1}",
        "learner.ray_resources={learner_host: 1}",
        f"train.total_steps={args.steps}",
        # The post-sync log-prob probe calls engine 0 outside the death watch: a node death noticed
        # there ends the run with ActorDiedError instead of a replacement (seen).
        "train.mismatch_probe_samples=0",
        f"logging.run_dir={run_dir}",
        "logging.run_name=run",
        "logging.wandb.mode=disabled",
        *args.overrides,
    ]
    summary = Summary(hosts={h.name: h.ip for h in cluster.hosts}, launch_command=launch)
    proc: subprocess.Popen | None = None
    try:
        cluster.up()
        summary.cluster_up_s = time.perf_counter() - t0
        print(
            f"cluster up in {summary.cluster_up_s:.1f}s: "
            + ", ".join(f"{h.name} {h.ip}" for h in cluster.hosts),
            flush=True,
        )
        env = cluster.env()
        log = open(out / "launch.log", "w")
        t_run = time.perf_counter()
        proc = subprocess.Popen(
            cluster.in_ns(cluster.head, *launch),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines: list[str] = []

        def pump() -> None:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                stamped = f"{time.perf_counter() - t_run:7.1f}s | {line}"
                log.write(stamped)
                log.flush()
                print(f"  {stamped}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        metrics = run_dir / "run" / "metrics.jsonl"
        killed_at = 0.0
        steps_at_replacement = -1
        deadline = time.monotonic() + args.timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            done = _count_lines(metrics)
            if not summary.killed_host and done >= args.kill_after:
                summary.roles_before_kill = cluster.roles()
                summary.connections = cluster.connections()
                victim = engine_host(summary.roles_before_kill)
                pid = cluster.raylet_pid(cluster.host(victim)) if victim else None
                if pid is None:
                    raise RuntimeError(f"no engine host with a raylet found: {summary.roles_before_kill}")
                os.kill(pid, signal.SIGKILL)
                killed_at = time.perf_counter()
                summary.killed_host, summary.killed_raylet_pid, summary.killed_after_step = victim, pid, done
                print(
                    f"{killed_at - t_run:7.1f}s killed the raylet of {victim} ({cluster.host(victim).ip}), "
                    f"pid {pid}, after step {done}",
                    flush=True,
                )
            elif summary.killed_host and not summary.replaced_on:
                if summary.engine_gone_s < 0 and "engine" not in cluster.roles()[summary.killed_host]:
                    summary.engine_gone_s = time.perf_counter() - killed_at
                if steps_at_replacement < 0 and any("started engine" in line for line in lines):
                    steps_at_replacement = done
                if 0 <= steps_at_replacement < done:  # a step finished with the replacement serving
                    roles = cluster.roles()
                    if engine_host(roles) not in ("", summary.killed_host):
                        summary.roles_after_recovery = roles
                        summary.replaced_on = engine_host(roles)
                        summary.recovery_s = time.perf_counter() - killed_at
            time.sleep(0.5)
        if proc.poll() is None:
            raise RuntimeError(f"the run did not finish within {args.timeout_s:.0f}s")
        reader.join(timeout=10)
        if summary.killed_host:
            summary.killed_host_left = cluster.roles()[summary.killed_host]
        summary.exit_code = proc.returncode
        summary.run_s = time.perf_counter() - t_run
        summary.steps_done = _count_lines(metrics)
        errors = [line for line in lines if line.startswith("error:")]
        summary.error_line = errors[-1] if errors else ""
        summary.recovery_events = [line for line in lines if line.startswith("[recovery]")]
        return summary
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the launch and its children only
            proc.wait(timeout=30)
        summary.leftovers = cluster.down()
        summary.total_s = time.perf_counter() - t0
        (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))


def _count_lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="multihost-demo", help="folder for the run, its log and summary.json")
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument(
        "--steps",
        type=int,
        default=60,
        help="train.total_steps (tiny steps: enough that the run outlives the kill)",
    )
    ap.add_argument(
        "--kill-after", type=int, default=2, help="kill the engine host's raylet after this many steps"
    )
    ap.add_argument("--generator-hosts", type=int, default=2, help="1: nothing can host the replacement")
    ap.add_argument("--subnet", default="10.77.0", help="first three octets of the private test subnet")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("overrides", nargs="*", help="more section.key=value overrides for the launch")
    return ap.parse_args(argv)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(143)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # `timeout`, CI cancel: clean up all the same
    why = can_make_namespaces()
    if why:
        print(f"error: {why} (this demo needs root and iproute2)", file=sys.stderr)
        return 2
    summary = run_demo(args)
    print(json.dumps(asdict(summary), indent=2))
    ok = summary.exit_code == 0 and summary.replaced_on and not summary.leftovers
    if args.generator_hosts == 1:
        ok = summary.exit_code == 1 and summary.error_line and not summary.leftovers
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
