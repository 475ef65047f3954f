"""What the trainer and the vLLM worker both import: the wire formats, one module each, and the
broadcast carriers.

    layout.py           a bucket's bytes: dtype sizes, tensor offsets, views of a received buffer
    shm_format.py       backend `vime_shm`: a bucket in a tmpfs file (`ShmBucketInfo`)
    broadcast_format.py backend `vime_broadcast`: group and bucket descriptors
    broadcast_group.py  the NCCL and gloo groups a `vime_broadcast` bucket travels in
    ipc_format.py       vLLM's own `ipc` backend: the packed bucket's `update_info`, GPU keys
    spec_format.py      what an engine's model accepts (`vime_weight_spec`), from its checkpoint

These run inside vLLM's worker: standard library and torch only (torch imported where a
function needs it, so the configuration can read a backend name without loading torch), and no
other vime module than this package (tests/unit/test_weight_sync_layout.py checks both).
"""
