"""Code that runs *inside* the vLLM server process (loaded through `--worker-extension-cls`).

Everything here imports only vllm, torch and the standard library: the vLLM environment does
not have the trainer's packages. `worker_ext` registers the `vime_shm` weight-transfer backend
(`shm_backend`) with vLLM's `WeightTransferEngineFactory` when the worker imports it.
"""
