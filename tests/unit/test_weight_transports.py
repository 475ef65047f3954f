"""Transport payloads that can be checked without an engine: the shared-memory bucket format,
the CUDA IPC update_info (built on CPU with a stand-in handle), and the disk files."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from vime_core.weight_sync.buckets import iter_buckets
from vime_core.wire.shm_format import ALIGNMENT, ShmBucketInfo


def bucket_of(tensors: dict, dtypes: dict | None = None):
    (bucket,) = iter_buckets(tensors.items(), 1 << 30, dtypes)
    return bucket


TENSORS = {"w": torch.randn(5, 3), "b": torch.randn(7), "s": torch.tensor(2.5)}


def test_shm_bucket_file_holds_each_tensor_at_its_aligned_offset(tmp_path):
    from vime_core.weight_sync.transport.shm import write_bucket_file
    from vime_core.weight_sync.transport.shm_pool import ShmBufferPool

    pool = ShmBufferPool(str(tmp_path))
    info = write_bucket_file(bucket_of(TENSORS, {n: torch.bfloat16 for n in TENSORS}), pool)
    assert all(off % ALIGNMENT == 0 for off in info.offsets)
    assert (
        info.path == pool.path_of(0)
        and os.path.basename(info.path).startswith(f"vime-wb-{os.getpid()}-")
        and os.path.getsize(info.path) == info.nbytes
    )
    raw = torch.frombuffer(bytearray(open(info.path, "rb").read()), dtype=torch.uint8)
    for name, shape, off in zip(info.names, info.shapes, info.offsets):
        n = torch.Size(shape).numel() * 2
        assert torch.equal(raw[off : off + n].view(torch.bfloat16).view(shape), TENSORS[name].to(torch.bfloat16))
    assert ShmBucketInfo(**info.to_dict()) == info  # survives the JSON round trip as a dict
    pool.release()
    assert os.listdir(tmp_path) == []


@pytest.mark.integration  # a child process, to have a dead pid
def test_shm_pool_reuses_slot_files_grows_them_and_removes_files_of_dead_processes(tmp_path):
    import subprocess
    import sys

    from vime_core.weight_sync.transport.shm_pool import ShmBufferPool

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [tmp_path / f"vime-wb-{int(dead.stdout)}-00000", tmp_path / f"vime-wb-{int(dead.stdout)}-0a1b2c3d-00000"]
    for path in stale:
        path.write_bytes(b"old")
    other = tmp_path / "unrelated-file"
    other.write_bytes(b"keep")
    pool = ShmBufferPool(str(tmp_path))
    assert not any(path.exists() for path in stale) and other.exists()
    assert pool.path_of(0) != ShmBufferPool(str(tmp_path)).path_of(0)  # two pools never share a file

    path, flat = pool.buffer(0, 100)
    flat.fill_(7)
    inode = os.stat(path).st_ino
    path_again, small = pool.buffer(0, 50)  # fits: same file, same pages
    assert path_again == path and os.stat(path).st_ino == inode and int(small[0]) == 7
    _, big = pool.buffer(0, 4096)  # grows in place
    assert big.numel() == 4096 and os.path.getsize(path) == 4096 and pool.nbytes() == 4096
    pool.buffer(1, 10)
    assert pool.paths() == [path, pool.path_of(1)]
    pool.release()
    assert sorted(os.listdir(tmp_path)) == ["unrelated-file"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"offsets": [0, 8]}, "misaligned"),
        ({"offsets": [0, 64], "nbytes": 70}, "outside"),
        ({"path": "/dev/shm/other"}, "must start with"),
        ({"shapes": [[2]]}, "shapes has 1 entries"),
        ({"dtype_names": ["float32", "complex64"]}, "unsupported dtype"),
    ],
)
def test_shm_descriptor_rejects_what_the_worker_must_not_map(change, message):
    good = {
        "path": "/dev/shm/vime-wb-x-00000",
        "nbytes": 128,
        "names": ["a", "b"],
        "dtype_names": ["float32", "float32"],
        "shapes": [[2], [4]],
        "offsets": [0, 64],
    }
    with pytest.raises(ValueError, match=message):
        ShmBucketInfo(**{**good, **change})


def test_ipc_update_info_matches_what_vllm_unpacks():
    from vime_core.weight_sync.buckets import pack_ipc
    from vime_core.wire.ipc_format import ipc_update_info

    bucket = bucket_of(TENSORS, {n: torch.bfloat16 for n in TENSORS})
    buffer, sizes = pack_ipc(bucket, torch.device("cpu"))
    info = ipc_update_info(bucket, sizes, {"GPU-uuid": ("handle-args",)})
    assert set(info) == {"names", "dtype_names", "shapes", "tensor_sizes", "ipc_handles_pickled"}
    assert pickle.loads(base64.b64decode(info["ipc_handles_pickled"])) == {"GPU-uuid": ("handle-args",)}
    assert sum(info["tensor_sizes"]) == buffer.numel()
    # vLLM's packed consumer: split by tensor_sizes, view each slice as its dtype and shape
    for name, dtype, shape, part in zip(
        info["names"], info["dtype_names"], info["shapes"], buffer.split(info["tensor_sizes"])
    ):
        assert torch.equal(part.view(getattr(torch, dtype)).view(shape), TENSORS[name].to(torch.bfloat16))


def test_ipc_refuses_a_layout_vllm_could_not_view():
    from vime_core.weight_sync.buckets import pack_ipc

    odd = bucket_of({"h": torch.zeros(3), "f": torch.zeros(2)}, {"h": torch.bfloat16, "f": torch.float32})
    with pytest.raises(ValueError, match="'f'.*byte 6"):
        pack_ipc(odd, torch.device("cpu"))


def test_disk_bucket_is_a_safetensors_file_in_wire_dtypes(tmp_path):
    from safetensors.torch import load_file

    from vime_core.weight_sync.transport.disk import write_bucket_safetensors

    path = write_bucket_safetensors(bucket_of(TENSORS, {n: torch.float16 for n in TENSORS}), str(tmp_path))
    loaded = load_file(path)
    assert {n: t.dtype for n, t in loaded.items()} == {n: torch.float16 for n in TENSORS}
    assert all(torch.equal(loaded[n], t.to(torch.float16)) for n, t in TENSORS.items())
