"""Weight sync: the trainer's HF-named weights into running vLLM engines, both ends.

Trainer side (rank 0 drives a publish; with CUDA IPC every rank packs):

    publish.py       `publish_weights`: validate, pause, start, buckets, finish, resume, verify
    publish_loop.py  what a publisher keeps between publishes (event loop, engine clients,
                     shared-memory pools, broadcast groups)
    buckets.py       tensors into buckets of a bounded wire size, packed into flat buffers
                     (`pack_flat`, and `pack_ipc` into memory CUDA IPC can share)
    allocator.py     the trainer's CUDA allocator: expandable segments, except for IPC buffers
    weight_spec.py   a publish checked against each engine's model before any byte moves
    weight_check.py  did the publish arrive (`check_weight_update_equal`)
    transport/       one interface, five transports picked by placement (shm, ipc, nccl, gloo, disk)

Both ends (`wire/`): the formats the trainer writes and the engines read, one module each
(bucket byte layout, shared-memory and broadcast descriptors, IPC handle packing, the weight
spec) and the broadcast carriers. The engine side's receivers live in
`vime_core/engines/vllm_side/` (they run inside vLLM's worker) and import only `wire/`.

Nothing is imported here: `wire/` must stay importable in the vLLM environment, which has
neither the trainer's packages nor Prefect.
"""
