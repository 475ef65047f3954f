"""Device memory read through nvidia-smi (vime_core/utils/device_memory), against a stand-in
nvidia-smi on PATH that answers the two queries the module makes."""

import os
import stat

import pytest

from vime_core.utils import device_memory as dm

FAKE = """#!/bin/sh
case "$1" in
  --query-compute-apps=*) echo "{me}, 1024"; echo "999999, 4096" ;;
  --query-gpu=*) echo "0, 81920, 20480"; echo "1, 81920, 0" ;;
esac
"""


def _fake_smi(tmp_path, monkeypatch):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE.format(me=os.getpid()))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


@pytest.mark.integration  # runs a stand-in nvidia-smi
def test_process_bytes_counts_only_the_given_pids(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch)
    assert dm.processes_bytes({os.getpid()}) == 1024 * dm.MIB
    assert dm.processes_bytes({1}) is None  # listed apps hold none of these pids


@pytest.mark.integration  # runs a stand-in nvidia-smi
def test_free_and_total_per_device_and_group_memory(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch)
    assert dm.free_and_total() == {"0": (61440 * dm.MIB, 81920 * dm.MIB), "1": (81920 * dm.MIB, 81920 * dm.MIB)}
    got = dm.group_device_memory(os.getpgid(0), ["0"])
    assert got == {"process_bytes": 1024 * dm.MIB, "device_used_bytes": {"0": 20480 * dm.MIB}}


def test_without_nvidia_smi_nothing_is_known(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert dm.processes_bytes({os.getpid()}) is None and dm.free_and_total() == {}
