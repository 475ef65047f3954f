"""The engine end of weight sync, running inside the vLLM server process: the worker extension, the
`vime_shm` and `vime_broadcast` receivers, their shared reload session, and the authentication
middleware. It imports only vllm, torch, the standard library and vime_core.wire, because the vLLM
environment has neither the trainer's packages nor Prefect (tests/unit/test_weight_sync_layout.py)."""
