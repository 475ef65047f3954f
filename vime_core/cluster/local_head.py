"""A local Ray head on loopback (and worker nodes joined to it), for one machine; infra/ray_head.sh calls it:
`python -m vime_core.cluster.local_head start --num-gpus 1` prints the address; `status`, `stop`,
`join --address 127.0.0.1:PORT --node-ip-address 127.0.0.2 ...` and `leave --temp-dir DIR` do what they say."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping

from vime_core.utils.processes import cmdline, free_port, group_tree, pid_alive
from vime_core.utils.retry import poll_until

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TEMP_DIR = REPO / ".cache" / "ray"
TEMP_DIR_ENV = "VIME_RAY_TEMP_DIR"  # the command lines' default --temp-dir
NUM_GPUS_ENV = "VIME_NUM_GPUS"  # this module's default --num-gpus
STATE_FILE = "vime_head.json"
WORKER_STATE_FILE = "vime_worker.json"
from vime_core.cluster.connect import LOOPBACK_ENV  # noqa: E402  (one definition for heads and drivers)


def _ray_command() -> list[str]:
    """The `ray` CLI of this interpreter: its console script when installed beside it, else the
    CLI's module run by this interpreter (a site folder unpacked with `pip --target` has no
    usable console script: its shebang names the machine that built it)."""
    beside = Path(sys.executable).parent / "ray"
    if beside.exists():
        return [str(beside)]
    return [
        sys.executable,
        "-c",
        "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())",
    ]


# Ray puts Unix sockets at <temp>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store: with a
# ~42-character session name that leaves about 40 characters for the temp dir within the
# 107-byte socket path limit.
_MAX_TEMP_DIR_LEN = 40


def default_temp_dir(environ: Mapping[str, str] = os.environ) -> str:
    """The command lines' default --temp-dir: $VIME_RAY_TEMP_DIR, else the repository's .cache/ray."""
    return environ.get(TEMP_DIR_ENV) or str(DEFAULT_TEMP_DIR)


def _temp_dir(temp_dir: str | Path | None) -> Path:
    """The temp dir asked for (None: DEFAULT_TEMP_DIR), or (when its path is too long for Ray's
    sockets) a short one under /tmp derived from it, so every caller naming the same folder gets
    the same head."""
    wanted = Path(temp_dir or DEFAULT_TEMP_DIR).resolve()
    if len(str(wanted)) <= _MAX_TEMP_DIR_LEN:
        return wanted
    digest = hashlib.sha256(str(wanted).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"vime-ray-{digest}"


def _read_state(temp_dir: Path, name: str = STATE_FILE) -> dict | None:
    try:
        return json.loads((temp_dir / name).read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ---- processes ----------------------------------------------------------------------------------
_head_processes = group_tree  # a node's processes: `ray start`'s group and all their descendants


def _gcs_alive(state: dict) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", int(state["gcs_port"])), timeout=1.0):
            pass
    except OSError:
        return False
    return any("gcs_server" in " ".join(cmdline(pid)) for pid in _head_processes(int(state["pgid"])))


# ---- public ---------------------------------------------------------------------------------------
def head_running(temp_dir: str | Path | None = None) -> str | None:
    """The address (`127.0.0.1:PORT`) of the head started for `temp_dir`, if it is running."""
    state = _read_state(_temp_dir(temp_dir))
    return state["address"] if state and _gcs_alive(state) else None


def _ray_start(
    command: list[str],
    env: dict[str, str],
    temp: Path,
    num_gpus: int,
    num_cpus: int | None,
    resources: dict[str, float] | None,
    object_store_memory: int,
    timeout: float,
    what: str,
) -> tuple[subprocess.Popen, str]:
    """Run `command` (a `ray start` of either node kind) with what both kinds share: every port
    a free one, the node's resources, its temp dir. Returns the finished process (its pid leads
    the process group the node's daemons inherit) and its output."""
    env = {
        **LOOPBACK_ENV,
        **os.environ,
        **env,
        "AUTOSCALER_METRIC_PORT": str(free_port()),
        "DASHBOARD_METRIC_PORT": str(free_port()),
    }
    args = [
        *command,
        f"--node-manager-port={free_port()}",
        f"--object-manager-port={free_port()}",
        "--min-worker-port=0",
        "--max-worker-port=0",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        "--disable-usage-stats",
        f"--num-gpus={int(num_gpus)}",
        f"--object-store-memory={int(object_store_memory)}",
        f"--temp-dir={temp}",
    ]
    if num_cpus is not None:
        args.append(f"--num-cpus={int(num_cpus)}")
    if resources:
        args.append(f"--resources={json.dumps(resources)}")
    # A new session makes `ray start` the leader of a process group its daemons inherit:
    # that group (plus descendants) is exactly what stopping the node ends.
    process = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_processes(process.pid)
        raise TimeoutError(f"{what} did not finish in {timeout:.0f} s") from None
    return process, output


def _start_failed(process: subprocess.Popen, output: str, what: str) -> None:
    _end_processes(process.pid)
    raise RuntimeError(f"{what} failed (exit {process.returncode}):\n" + "\n".join(output.splitlines()[-15:]))


def start_local_head(
    num_gpus: int,
    num_cpus: int | None = None,
    temp_dir: str | Path | None = None,
    object_store_memory: int = 1 << 30,
    timeout: float = 180.0,
    port: int | None = None,
    resources: dict[str, float] | None = None,
) -> str:
    """Start a Ray head on loopback with `num_gpus` device slots; return its address.

    `port` fixes the GCS port (the address drivers use); by default a free one is taken.
    `resources`: custom node resources to declare (e.g. `{"vime_trainer": 1}`, see
    trainer_node_resource).

    Idempotent: if a head for this temp dir runs, its address is returned (a different
    num_gpus or resources is reported in the log, not changed: stop the head to change it).

    Loopback only (--node-ip-address=127.0.0.1 and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which drivers
    need too: vime_core.cluster.connect sets it); every port free, the two metrics ports included;
    `num_gpus` device slots even without GPUs, so placement groups behave as on a GPU node; no
    dashboard; a capped object store. Idempotent: a running head for the same temp dir is reused.
    """
    temp = _temp_dir(temp_dir)
    running = _read_state(temp)
    if running and _gcs_alive(running):
        if (running.get("num_gpus"), running.get("num_cpus"), running.get("resources") or {}) != (
            num_gpus,
            num_cpus,
            resources or {},
        ):
            log.warning(
                "Ray head at %s runs with num_gpus=%s num_cpus=%s resources=%s (asked %s/%s/%s); reusing it",
                running["address"],
                running.get("num_gpus"),
                running.get("num_cpus"),
                running.get("resources"),
                num_gpus,
                num_cpus,
                resources,
            )
        return running["address"]
    temp.mkdir(parents=True, exist_ok=True)
    gcs_port = port or free_port()
    command = [
        *_ray_command(),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs_port}",
        f"--dashboard-port={free_port()}",
        "--include-dashboard=false",
    ]
    process, output = _ray_start(
        command, {}, temp, num_gpus, num_cpus, resources, object_store_memory, timeout, "`ray start --head`"
    )
    address = f"127.0.0.1:{gcs_port}"
    state = {
        "address": address,
        "gcs_port": gcs_port,
        "pgid": process.pid,
        "temp_dir": str(temp),
        "num_gpus": num_gpus,
        "num_cpus": num_cpus,
        "resources": resources or {},
    }
    if process.returncode != 0:
        _start_failed(process, output, "`ray start --head`")
    (temp / STATE_FILE).write_text(json.dumps(state))
    if not poll_until(lambda: _gcs_alive(state), timeout_s=30, interval_s=0.2):
        stop_local_head(temp)
        raise TimeoutError(f"Ray head at {address} started but its GCS does not answer")
    log.info("Ray head at %s (num_gpus=%s, temp dir %s)", address, num_gpus, temp)
    return address


def _end_processes(pgid: int, grace: float = 3.0) -> int:
    """SIGTERM the head's processes, SIGKILL what is left after `grace` s; returns how many.

    gcs_server and the autoscaler monitor ignore SIGTERM for a long while and the raylet is slow
    to stop; a local head keeps nothing worth that wait (its detached actors end with it anyway).
    """
    pids = _head_processes(pgid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    poll_until(lambda: not any(pid_alive(p) for p in pids), timeout_s=grace, interval_s=0.2)
    for pid in _head_processes(pgid) + [p for p in pids if pid_alive(p)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # SIGKILLed processes take a moment to become zombies
    poll_until(lambda: not any(pid_alive(p) for p in pids), timeout_s=5.0, interval_s=0.1)
    return len(pids)


def stop_local_head(temp_dir: str | Path | None = None, grace: float = 3.0) -> bool:
    """Stop the head started for `temp_dir` and everything it started; False if none ran.

    It ends exactly the process group `ray start` created and its descendants, never `ray stop`,
    which ends every Ray on the machine."""
    temp = _temp_dir(temp_dir)
    state = _read_state(temp)
    if state is None:
        return False
    ended = _end_processes(int(state["pgid"]), grace)
    (temp / STATE_FILE).unlink(missing_ok=True)
    log.info("stopped Ray head %s (%d processes)", state["address"], ended)
    return ended > 0


# `ray start` with its Windows/macOS multi-node guard lifted and nothing else changed (module
# docstring): run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray's address handling stays on loopback.
WORKER_LAUNCHER = """
import sys, types
import ray._private.ray_constants as constants
from ray.scripts import scripts
scripts.ray_constants = types.SimpleNamespace(**{**vars(constants), "ENABLE_RAY_CLUSTER": True})
sys.argv[0] = "ray"
sys.exit(scripts.main())
"""


def _raylet_alive(state: dict) -> bool:
    return any("raylet" in (cmdline(pid) or [""])[0] for pid in _head_processes(int(state["pgid"])))


def worker_running(temp_dir: str | Path) -> dict | None:
    """The state (node ip, head address, pgid, ...) of the worker node started for `temp_dir`,
    if its raylet runs."""
    state = _read_state(_temp_dir(temp_dir), WORKER_STATE_FILE)
    return state if state and _raylet_alive(state) else None


def start_local_worker(
    head_address: str,
    temp_dir: str | Path,
    node_ip: str = "127.0.0.2",
    num_gpus: int = 0,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
    object_store_memory: int = 256 << 20,
    timeout: float = 180.0,
    all_interfaces: bool = False,
) -> dict:
    """Start a Ray worker node on this machine joined to the head at `head_address`, with its own
    loopback address `node_ip` (not 127.0.0.1, the head's), free ports, `num_gpus` device slots,
    custom `resources` and its own `temp_dir`; returns its state (`node_ip`, `pgid`, ...).

    Idempotent for a temp dir whose worker runs. `stop_local_worker(temp_dir)` ends it (stopping
    the head does not: the worker's processes are not the head's).

    The node needs an address of its own (any 127.x.y.z reaches loopback on Linux). `ray start --address`
    refuses to join while RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 and, with it on, rewrites the head's
    127.0.0.1 to the public address, so the worker runs Ray's `ray start` with only that guard lifted
    (WORKER_LAUNCHER).

    Ray keeps a node's servers on loopback only when its address is exactly 127.0.0.1, so this
    node's raylet and its workers listen on every interface, and the local cluster runs without
    Ray's token authentication (connect.LOOPBACK_ENV): `all_interfaces` must say that this is
    wanted (a machine whose ports others cannot reach), else ValueError.
    """
    if node_ip in ("127.0.0.1", "localhost") or not node_ip.startswith("127."):
        raise ValueError(f"node_ip={node_ip!r}: a local worker needs a loopback address of its own (127.0.0.2 ...)")
    if not all_interfaces:
        raise ValueError(
            f"node_ip={node_ip!r}: Ray binds a node's raylet and workers to every interface unless its address is "
            "exactly 127.0.0.1, and the local cluster has no Ray authentication: pass --all-interfaces "
            "(all_interfaces=True) only on a machine whose ports other machines cannot reach"
        )
    temp = _temp_dir(temp_dir)
    running = worker_running(temp)
    if running:
        return running
    temp.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-c",
        WORKER_LAUNCHER,
        "start",
        f"--address={head_address}",
        f"--node-ip-address={node_ip}",
    ]
    what = f"`ray start --address={head_address}`"
    process, output = _ray_start(
        command,
        {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},  # WORKER_LAUNCHER relies on it
        temp,
        num_gpus,
        num_cpus,
        resources,
        object_store_memory,
        timeout,
        what,
    )
    state = {
        "head_address": head_address,
        "node_ip": node_ip,
        "pgid": process.pid,
        "temp_dir": str(temp),
        "num_gpus": num_gpus,
        "num_cpus": num_cpus,
        "resources": resources or {},
    }
    if process.returncode != 0 or not _raylet_alive(state):
        _start_failed(process, output, what)
    (temp / WORKER_STATE_FILE).write_text(json.dumps(state))
    log.info(
        "Ray worker node %s joined %s (num_gpus=%s, resources=%s, temp dir %s)",
        node_ip,
        head_address,
        num_gpus,
        resources or {},
        temp,
    )
    return state


def stop_local_worker(temp_dir: str | Path, grace: float = 3.0) -> bool:
    """Stop the worker node started for `temp_dir` and everything it started; False if none ran.
    The head marks the node dead by itself (after its health-check timeout)."""
    temp = _temp_dir(temp_dir)
    state = _read_state(temp, WORKER_STATE_FILE)
    if state is None:
        return False
    ended = _end_processes(int(state["pgid"]), grace)
    (temp / WORKER_STATE_FILE).unlink(missing_ok=True)
    log.info("stopped Ray worker node %s (%d processes)", state["node_ip"], ended)
    return ended > 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vime_core.cluster.local_head", description="A local Ray head on loopback."
    )
    parser.add_argument(
        "command",
        choices=["start", "stop", "status", "join", "leave"],
        help="start/stop/status: the head; join/leave: a worker node on this machine",
    )
    parser.add_argument(
        "--num-gpus",
        type=int,
        default=int(os.environ.get(NUM_GPUS_ENV, "1")),
        help=f"device slots to declare (default ${NUM_GPUS_ENV}, else 1)",
    )
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs to declare (default: all)")
    parser.add_argument(
        "--temp-dir",
        default=None,
        help=f"Ray temp dir: start/stop/status: the head's (default ${TEMP_DIR_ENV}, else {DEFAULT_TEMP_DIR}); "
        "join/leave: the worker node's own (required)",
    )
    parser.add_argument("--object-store-memory", type=int, default=1 << 30, help="object store bytes (default 1 GiB)")
    parser.add_argument(
        "--port", type=int, default=None, help="GCS port, i.e. the address's port (default: a free one)"
    )
    parser.add_argument(
        "--resources", type=json.loads, default=None, help="custom node resources, JSON (e.g. '{\"vime_engine\": 1}')"
    )
    parser.add_argument("--address", default=None, help="join: the head's address (default: the local head's)")
    parser.add_argument(
        "--node-ip-address", default="127.0.0.2", help="join: the worker's own loopback address (default 127.0.0.2)"
    )
    parser.add_argument(
        "--all-interfaces",
        action="store_true",
        help="join: required; the worker's raylet and workers listen on every interface (Ray keeps only "
        "127.0.0.1 on loopback) without Ray's authentication: only on a machine others cannot reach",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    head_temp_dir = default_temp_dir()  # the head's, where --temp-dir names the worker's
    if args.command in ("start", "stop", "status"):
        head_temp_dir = args.temp_dir or head_temp_dir
    if args.command == "start":
        print(
            start_local_head(
                args.num_gpus,
                args.num_cpus,
                head_temp_dir,
                args.object_store_memory,
                port=args.port,
                resources=args.resources,
            )
        )
        return 0
    if args.command in ("join", "leave"):
        if not args.temp_dir:
            parser.error(f"{args.command} needs --temp-dir (the worker node's own; not the head's)")
        if args.command == "leave":
            print("stopped" if stop_local_worker(args.temp_dir) else "not running")
            return 0
        head = args.address or head_running(head_temp_dir)
        if not head:
            parser.error("join: no local head running; pass --address")
        try:
            state = start_local_worker(
                head,
                args.temp_dir,
                args.node_ip_address,
                args.num_gpus,
                args.num_cpus,
                args.resources,
                args.object_store_memory,
                all_interfaces=args.all_interfaces,
            )
        except ValueError as err:  # the address or the missing --all-interfaces: one line, no traceback
            parser.error(f"join: {err}")
        print(state["node_ip"])
        return 0
    if args.command == "stop":
        print("stopped" if stop_local_head(head_temp_dir) else "not running")
        return 0
    address = head_running(head_temp_dir)
    print(address or "not running")
    return 0 if address else 3


if __name__ == "__main__":
    sys.exit(main())
