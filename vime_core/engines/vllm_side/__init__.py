"""Code that runs *inside* the vLLM server process (loaded through `--worker-extension-cls`).

Everything here imports only vllm, torch and the standard library: the vLLM environment does
not have the trainer's packages. `worker_ext` registers vime's weight-transfer backends with
vLLM's `WeightTransferEngineFactory` when the worker imports it: `vime_shm` (`shm_backend`,
buckets in shared memory) and `vime_broadcast` (`broadcast_backend`, buckets broadcast over NCCL
or gloo). The trainer imports the `*_format` and `broadcast_group` modules too.
"""
