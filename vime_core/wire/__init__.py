"""What the trainer and the vLLM worker both import: the wire formats, one module each (layout,
shm_format, broadcast_format, ipc_format, spec_format), the transfer checksum and the broadcast
carriers. Standard library and torch only, torch imported where a function needs it, and no other
vime module (tests/unit/test_weight_sync_layout.py checks both)."""
