"""vLLM's LoRA adapters as vime serves them (`lora_publish=adapter`): the server options, the
adapter names that carry the weight version, and the calls that load and unload one.

An engine started with `--enable-lora` serves the base checkpoint's weights, which never change,
plus adapters registered at run time (`POST /v1/load_lora_adapter`, present only where the
server's environment sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=1). Adapter version v is registered as
`adapter_name(v)` = "vime-lora-v<v>"; a generate request uses it by naming it as its `model`.
A request's adapter is fixed when the request is admitted, and vLLM keys its prefix cache on the
adapter's name and path, so a version's requests never reuse KV computed by another version.

Each name is registered once (vLLM gives it a fresh adapter id); re-registering one name
"in place" is avoided on purpose: vLLM then keeps `load_inplace` on the request the name maps to,
and its model runner hands every step's requests to `LRUCacheWorkerLoRAManager.add_adapter`,
which loads an adapter whose request says so from disk again (read in vLLM 0.32's source).

These routes answer plain text, not JSON, so they are called here rather than through
`EngineClient.request`. This module does not import vllm.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional

import aiohttp

from vime_core.config.lora import VLLM_LORA_RANKS
from vime_core.engines.auth import auth_headers
from vime_core.engines.client import EngineError

if TYPE_CHECKING:
    from vime_core.engines.client import EngineClient

ADAPTER_PREFIX = "vime-lora-v"
LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
RUNTIME_UPDATES_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
# One adapter on the device (a publish aborts the requests of the previous version), the
# previous version's kept on the host for requests sent before their client moved on.
MAX_LORAS, MAX_CPU_LORAS = 1, 2
_NAME = re.compile(re.escape(ADAPTER_PREFIX) + r"(\d+)$")


def adapter_name(version: int) -> str:
    return f"{ADAPTER_PREFIX}{int(version)}"


def adapter_version(name: str) -> Optional[int]:
    """The version a vime adapter name carries; None for any other model name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def serves_adapters(cfg: Any) -> bool:
    """Whether the engines are started for adapter publishes: lora_publish=adapter, lora_rank > 0
    (fields of the schema's LoRA section; read by name, as that section may be absent)."""
    return getattr(cfg, "lora_publish", "merged") == "adapter" and getattr(cfg, "lora_rank", 0) > 0


def served_name(cfg: Any, version: int) -> Optional[str]:
    """The model a generate request names to be served by weights `version`: the adapter of that
    version where the engines serve adapters and one was published (version >= 1), else None
    (the engine's own weights)."""
    return adapter_name(version) if serves_adapters(cfg) and version >= 1 else None


def lora_server_args(rank: int) -> dict[str, Any]:
    """EngineServer server_args that enable LoRA up to `rank` (rounded up to a rank vLLM takes)."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if rank <= 0 or not fitting:
        raise ValueError(f"lora_rank={rank}: vLLM serves adapters of rank 1 to {VLLM_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": MAX_LORAS, "max_cpu_loras": MAX_CPU_LORAS}


async def _post(client: "EngineClient", path: str, body: dict) -> str:
    """POST `body` to one engine; its text answer. Failures as `EngineError`, as the client's."""
    endpoint = f"POST {path}"
    timeout = aiohttp.ClientTimeout(total=client.control_timeout_s)
    try:
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.post(
                client.base_url + path, json=body, headers=auth_headers(client.token), timeout=timeout
            ) as resp:
                status, text = resp.status, await resp.text(errors="replace")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineError(client.name, endpoint, None, f"{type(exc).__name__}: {exc}") from None
    if status >= 400:
        raise EngineError(client.name, endpoint, status, text)
    return text


async def load_adapter(client: "EngineClient", name: str, folder: str) -> None:
    """Register the PEFT folder `folder` (on the engine's machine) as `name`; vLLM loads it into
    its workers before answering, and a folder it cannot load leaves it serving as before."""
    await _post(client, LOAD_PATH, {"lora_name": name, "lora_path": folder})


async def unload_adapter(client: "EngineClient", name: str) -> None:
    await _post(client, UNLOAD_PATH, {"lora_name": name})


async def served_adapters(client: "EngineClient") -> dict[str, str]:
    """The engine's registered vime adapters: name -> the folder it was loaded from."""
    cards = await client.served_models()
    return {c["id"]: c.get("root", "") for c in cards if adapter_version(str(c.get("id", ""))) is not None}
