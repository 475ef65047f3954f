"""A worker node on this machine: the addresses it refuses and the CLI's required folder; where
the command lines take the head's temp dir from. Without starting Ray
(tests/integration/cluster/test_two_nodes.py and test_local_ray_head.py start them for real)."""

from __future__ import annotations

import pytest

from vime_core.cluster import local_head


@pytest.mark.parametrize("ip", ["127.0.0.1", "localhost", "10.0.0.2"])
def test_a_local_worker_needs_a_loopback_address_of_its_own(ip, tmp_path):
    with pytest.raises(ValueError, match="loopback address of its own"):
        local_head.start_local_worker("127.0.0.1:6379", tmp_path, node_ip=ip)


def test_a_local_worker_listening_on_every_interface_is_asked_for_by_name(tmp_path, capsys):
    """Ray binds a node whose address is not exactly 127.0.0.1 on every interface: joining is refused,
    naming the flag, until it is passed; nothing is started (the head address below runs nothing)."""
    with pytest.raises(ValueError, match="--all-interfaces") as err:
        local_head.start_local_worker("127.0.0.1:6379", tmp_path, node_ip="127.0.0.2")
    assert "every interface" in str(err.value)
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        local_head.main(["join", "--address", "127.0.0.1:6379", "--temp-dir", str(tmp_path / "w")])
    assert "--all-interfaces" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


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


def test_the_temp_dir_variable_is_read_by_the_command_lines_never_by_the_library(tmp_path, monkeypatch):
    from flows import cli

    from_env, from_flag = tmp_path / "env", tmp_path / "flag"
    monkeypatch.setenv(local_head.TEMP_DIR_ENV, str(from_env))
    assert local_head._temp_dir(None) == local_head._temp_dir(local_head.DEFAULT_TEMP_DIR)
    asked: list[str] = []
    monkeypatch.setattr(local_head, "head_running", lambda temp_dir=None: asked.append(str(temp_dir)))
    assert cli.main(["cluster", "status"]) == 1 and local_head.main(["status"]) == 3
    assert cli.main(["cluster", "status", "--temp-dir", str(from_flag)]) == 1
    assert local_head.main(["status", "--temp-dir", str(from_flag)]) == 3
    assert asked == [str(from_env)] * 2 + [str(from_flag)] * 2
    monkeypatch.delenv(local_head.TEMP_DIR_ENV)
    assert local_head.default_temp_dir() == str(local_head.DEFAULT_TEMP_DIR)
