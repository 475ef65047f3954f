"""A worker node on this machine: the addresses it refuses and the CLI's required folder, without
starting Ray (tests/integration/cluster/test_two_nodes.py starts one for real)."""

from __future__ import annotations

import pytest

from vime_core.cluster import local_head


@pytest.mark.parametrize("ip", ["127.0.0.1", "localhost", "10.0.0.2"])
def test_a_local_worker_needs_a_loopback_address_of_its_own(ip, tmp_path):
    with pytest.raises(ValueError, match="loopback address of its own"):
        local_head.start_local_worker("127.0.0.1:6379", tmp_path, node_ip=ip)


def test_join_and_leave_need_the_workers_own_temp_dir(capsys):
    for command in ("join", "leave"):
        with pytest.raises(SystemExit):
            local_head.main([command])
        assert "--temp-dir" in capsys.readouterr().err


def test_leave_without_a_worker_says_so(tmp_path, capsys):
    assert local_head.main(["leave", "--temp-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "not running"
    assert local_head.worker_running(tmp_path) is None


def test_port_is_free_sees_a_listening_socket():
    import socket

    from vime_core.utils.processes import free_port, port_is_free

    port = free_port()
    assert port_is_free("127.0.0.1", port)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        assert not port_is_free("127.0.0.1", port)
