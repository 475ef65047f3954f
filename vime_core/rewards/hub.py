"""RewardHub: turns a configuration into "score this sample / this group". cfg.custom_rm_path
("module:function", sync or async, one Sample or with group_rm the group) else a built-in rm_type,
resolved at construction so a bad path fails at start. A reward function that raises or returns no
finite real number marks the sample FAILED and the rollout goes on (the rollout loop counts them)."""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from vime_core.config import VimeConfig
from vime_core.builtin_rewards import BUILTIN_REWARDS
from vime_core.config.derive import check_rm_type
from vime_core.data.sample import Sample, Status
from vime_core.rewards.remote import RemoteRewardModel
from vime_core.rewards.values import InvalidRewardError, as_reward, type_name
from vime_core.utils.imports import load_function


def remote_rm_token(cfg, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The remote reward model's bearer token, from where the configuration says it lives:
    the file `cfg.rm_api_key_file` (on this node), else the variable named by
    `cfg.rm_api_key_env` in this process's environment. None: no token (the default variable
    unset, or no source named). A file or a non-default variable that is missing or empty
    raises ValueError naming the field and the path or variable, never the token."""
    if cfg.rm_api_key_file:
        try:
            token = Path(cfg.rm_api_key_file).expanduser().read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"rm_api_key_file={cfg.rm_api_key_file!r}: cannot read the token file on this node "
                f"({type(exc).__name__}: {exc.strerror or 'unreadable'})"
            ) from None
        if not token:
            raise ValueError(f"rm_api_key_file={cfg.rm_api_key_file!r}: the token file is empty")
        return token
    name = cfg.rm_api_key_env
    token = environ.get(name, "").strip() if name else ""
    if token or not name or name == VimeConfig.model_fields["rm_api_key_env"].default:
        return token or None
    raise ValueError(
        f"rm_api_key_env={name!r}: that environment variable is not set (or empty) where the "
        f"RolloutManager runs; set it in the environment the Ray node starts with, or use rm_api_key_file"
    )


class RewardHub:
    def __init__(self, cfg) -> None:
        self.group_rm = bool(cfg.group_rm)
        check_rm_type(cfg)  # a configuration made without derive (a test's, a hook's) is checked here too
        if cfg.custom_rm_path:
            self.fn: Callable = load_function(cfg.custom_rm_path, field="custom_rm_path")
            self.name = cfg.custom_rm_path
            self.fn_takes_group = self.group_rm
        elif cfg.rm_type == "remote_rm":
            key = remote_rm_token(cfg)  # read once, here; kept only in the client's headers
            headers = {"Authorization": f"Bearer {key}"} if key else None
            self.fn = RemoteRewardModel(cfg.rm_url, timeout_s=cfg.rm_timeout_s, headers=headers)
            self.name = "remote_rm"
            self.fn_takes_group = False
        else:
            self.fn = load_function(BUILTIN_REWARDS[cfg.rm_type].function, field="rm_type")
            self.name = cfg.rm_type
            self.fn_takes_group = False

    def __repr__(self) -> str:
        return f"RewardHub({self.name}, group_rm={self.group_rm})"

    async def _call(self, arg: Any) -> Any:
        result = self.fn(arg)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def score(self, sample: Sample) -> None:
        """Set sample.reward; on any error mark the sample FAILED: "<Type>: <message>" in
        metadata["reward_error"] (stored with the batch), the type alone in metadata["reward_error_type"]
        (the only part logs show: a message may quote private text), reward 0.0."""
        try:
            if self.fn_takes_group:
                reward = as_reward(_group_values(await self._call([sample]), 1)[0])
            else:
                reward = as_reward(await self._call(sample))
        except Exception as exc:  # a user's reward function may raise anything
            mark_reward_failed(sample, exc)
            return
        sample.reward = reward

    async def score_group(self, samples: Sequence[Sample]) -> None:
        """Score a group: one call with the group's list (group_rm) or each sample concurrently.
        A group function's call that raises, or answers with the wrong length, fails every
        sample; a refused value fails only its own sample."""
        if not self.fn_takes_group:
            await asyncio.gather(*(self.score(s) for s in samples))
            return
        try:
            values = _group_values(await self._call(list(samples)), len(samples))
        except Exception as exc:
            for s in samples:
                mark_reward_failed(s, exc)
            return
        for s, value in zip(samples, values, strict=True):
            try:
                s.reward = as_reward(value)
            except InvalidRewardError as exc:
                mark_reward_failed(s, exc)


def mark_reward_failed(sample: Sample, exc: BaseException) -> None:
    sample.reward = 0.0
    sample.status = Status.FAILED
    sample.metadata["reward_error"] = f"{type(exc).__name__}: {exc}"
    sample.metadata["reward_error_type"] = exc.what if isinstance(exc, InvalidRewardError) else type(exc).__name__


def _group_values(values: Any, n: int) -> list:
    """A group function's answer as a list of `n` values: a list, a tuple, or a 1-d numpy array
    or torch tensor (read with `.tolist()`)."""
    if getattr(values, "ndim", None) == 1 and callable(getattr(values, "tolist", None)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        length = f" of length {len(values)}" if isinstance(values, (list, tuple)) else ""
        raise InvalidRewardError(
            f"returned {type_name(values)}{length} for a group of {n}", expected=f"a list of {n} numbers"
        )
    return list(values)
