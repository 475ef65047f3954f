"""Which Ray addresses are a node vime started on this machine (cluster/connect.is_local_address):
a driver attaching to one turns Ray's metrics off as the node's own processes do (LOCAL_RAY_ENV);
one attaching to another cluster keeps that cluster's settings."""

from __future__ import annotations

import pytest

from vime_core.cluster.connect import is_local_address


@pytest.mark.parametrize("address", ["auto", "127.0.0.1:6379", "localhost:6379", "[::1]:6379"])
def test_the_local_head_and_loopback_heads_are_local(address):
    assert is_local_address(address)


@pytest.mark.parametrize(
    "address", ["10.0.0.5:6379", "ray://head.example:10001", "head.internal:6379", "[fe80::1]:6379"]
)
def test_other_clusters_are_not(address):
    assert not is_local_address(address)
