"""bench_orchestration's count of the Prefect client's retries: it lets the client's DEBUG lines
through to itself only, so the console shows what it showed before the count began."""

from __future__ import annotations

import logging

from tests.bench_scripts import load_bench


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_retry_count_keeps_the_clients_debug_lines_off_the_console():
    bench = load_bench("bench_orchestration.py", "bench_orchestration")
    client, root = logging.getLogger("prefect.client"), logging.getLogger()
    console = _Kept()
    root.addHandler(console)
    before = (client.level, client.propagate)
    client.setLevel(logging.INFO)
    try:
        counter = bench.PrefectRetryCounter.attach()
        client.debug("Received response with retryable status code 503. Another attempt will be made in 1s.")
        client.debug("some other debug line")
        client.warning("a warning the console showed before")
        counter.detach()
        assert counter.count == 1
        assert [r.getMessage() for r in console.records if r.name == "prefect.client"] == [
            "a warning the console showed before"
        ]
        assert (client.level, client.propagate) == (logging.INFO, True)
    finally:
        root.removeHandler(console)
        client.setLevel(before[0])
        client.propagate = before[1]
