"""`VimeConfig`, the configuration a run uses, read from a YAML/JSON file, CLI flags, or both (flags
override the file). It is the schema's fields (config/schema.py) plus, whenever one is made: the
demo's settings when no model is named, per-field parsing and environment defaults, then the derived
values and cross-field checks (config/derive.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import (
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from vime_core.config.derive import derive_in_place
from vime_core.config.schema import ConfigFields
from vime_core.config.demo_settings import DEMO_SETTINGS, with_demo_settings
from vime_core.data.sources import parse_chat_template_kwargs
from vime_core.utils.secrets import is_credential_name, redact_secrets


class VimeConfig(ConfigFields):
    """Everything a vime run needs. The defaults are for real models on GPUs (slime's values);
    a configuration that names no model runs the embedded demo, whose settings
    (vime_core/demo/settings.py) apply to the fields it does not set."""

    @model_validator(mode="before")
    @classmethod
    def _embedded_demo(cls, values: Any) -> Any:
        return with_demo_settings(values) if isinstance(values, dict) else values

    @field_validator("apply_chat_template_kwargs", mode="before")
    @classmethod
    def _chat_template_kwargs(cls, value: Any) -> Any:
        return parse_chat_template_kwargs(value)

    @field_validator("storage_endpoint_url")
    @classmethod
    def _storage_endpoint_url(cls, value: str) -> str:
        # boundary: `vime train --help` imports this module, and vime_core.storage loads pyarrow
        from vime_core.storage.endpoint import resolve_endpoint_url

        return resolve_endpoint_url(value)  # the environment's when empty: once, here

    @field_validator("storage_region")
    @classmethod
    def _storage_region(cls, value: str) -> str:
        from vime_core.storage.endpoint import resolve_region  # boundary: `vime train --help` (pyarrow)

        return resolve_region(value)

    @model_validator(mode="after")
    def _derive(self) -> "VimeConfig":
        derive_in_place(self)
        return self

    @model_serializer(mode="wrap")
    def _credentials_redacted_as_json(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """As JSON (model_dump(mode="json"), model_dump_json) the configuration leaves the process:
        config.json, a batch's lineage, W&B, and Prefect's flow-run parameters (its UI and
        database), so its credentials are redacted there (vime_core/utils/secrets.py); the live
        object and its Python-mode dump keep them for the run."""
        values = handler(self)
        return redact_secrets(values) if info.mode_is_json() else values


class ConfigError(ValueError):
    """A configuration that does not parse; the message names the field or file."""


def _field_kind(annotation: Any) -> tuple[str, Any]:
    """('bool'|'list'|'scalar', element type) of a field annotation, unwrapping Optional."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _field_kind(args[0])
    if annotation is bool:
        return "bool", bool
    if origin is list:
        return "list", typing.get_args(annotation)[0]
    if origin is typing.Literal:
        return "scalar", str
    return "scalar", annotation


class BoolFlag(argparse.Action):
    """A boolean field's flags: `--x` (true), `--x false` / `--x true` (what pydantic reads as a
    bool; anything else is refused naming the field) and `--no-x` (false)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        flag = option_strings[0]
        super().__init__([flag, "--no-" + flag[2:]], dest, nargs="?", metavar="true|false", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value (got {values!r})")
            setattr(namespace, self.dest, False)
        else:
            setattr(namespace, self.dest, True if values is None else values)


class HelpFormatter(argparse.HelpFormatter):
    """Shows a BoolFlag as `--x [true|false], --no-x` (`--no-x` takes no value)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, BoolFlag):
            return f"{action.option_strings[0]} [{action.metavar}], {action.option_strings[1]}"
        return super()._format_action_invocation(action)


def build_parser(prog: str = "vime train", description: str | None = None) -> argparse.ArgumentParser:
    """Generated from the model, so `--help` shows every field's description and default without importing
    anything heavy. Not pydantic-settings' CLI: it refuses `--colocate false`, needs a custom source for a
    file plus overrides, and reads any environment variable named like a field."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=HelpFormatter,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # `--clip 0.28` must not set clip_grad when eps_clip was meant
    )
    parser.add_argument("--config", dest="config_file", help="YAML or JSON file of field values; flags override it.")
    for name, field in VimeConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind, elem = _field_kind(field.annotation)
        default = field.default if field.default_factory is None else field.default_factory()
        demo = f"; the embedded demo's: {DEMO_SETTINGS[name]}" if name in DEMO_SETTINGS else ""
        help_text = f"{field.description} (default: {default}{demo})".replace("%", "%%")
        choices = None
        if typing.get_origin(field.annotation) is typing.Literal:
            choices = list(typing.get_args(field.annotation))
        if kind == "bool":
            parser.add_argument(flag, dest=name, action=BoolFlag, help=help_text)
        elif kind == "list":  # repeated, the values add up: `--vllm-extra-args=--a=1 --vllm-extra-args=--b=2`
            parser.add_argument(
                flag, dest=name, action="extend", nargs="*", type=elem, metavar=name.upper(), help=help_text
            )
        else:
            parser.add_argument(
                flag, dest=name, type=str, choices=choices, metavar=None if choices else name.upper(), help=help_text
            )
    return parser


def _read_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        else:
            data = json.loads(text, object_pairs_hook=_unique_pairs)
    except Exception as exc:  # yaml.YAMLError / json.JSONDecodeError / a key given twice
        raise ConfigError(f"config file {path} does not parse: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of field names to values")
    fields = [(k.replace("-", "_"), k) for k in data]
    seen: dict[str, str] = {}
    for name, key in fields:
        if name in seen:
            raise ConfigError(f"config file {path} gives {name} twice ({seen[name]!r} and {key!r})")
        seen[name] = key
    return {name: data[key] for name, key in fields}


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object whose keys are each given once (json keeps the last silently)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice")
        out[key] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a mapping that gives a key twice (it keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
        if repeated:
            raise yaml.constructor.ConstructorError(None, None, f"key {repeated[0]!r} is given twice", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _from_cli_string(name: str, raw: str) -> Any:
    if raw.lower() in ("none", "null"):
        return None
    return raw  # pydantic converts "32" -> 32 etc. and names the field when it cannot


def make_config(values: dict, source: str = "configuration") -> VimeConfig:
    try:
        return VimeConfig(**values)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(config)"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(
                f"  {field}: {msg} (got {_shown_input(field, err.get('input'))})" if err["loc"] else f"  {msg}"
            )
        raise ConfigError(f"invalid {source}:\n" + "\n".join(lines)) from None


def _shown_input(field: str, value: Any) -> str:
    """A refused value as the error shows it: not at all for a field that names where a
    credential lives (`rm_api_key_env`: a user may have given the token itself) or names one,
    and redacted elsewhere."""
    if is_credential_name(field) or field.endswith(("_env", "_file")):
        return "a value not shown: the field may hold a credential"
    return repr(redact_secrets(value))


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> VimeConfig:
    values = _read_file(path) if path else {}
    values.update(overrides or {})
    return make_config(values, source=f"configuration ({path})" if path else "configuration")


def config_from_namespace(ns: dict, parser: argparse.ArgumentParser) -> VimeConfig:
    """The configuration from parsed flags (`--config FILE` plus overrides); a bad value ends
    the program through `parser.error` with the field named."""
    ns = dict(ns)
    path = ns.pop("config_file", None)
    overrides = {k: (_from_cli_string(k, v) if isinstance(v, str) else v) for k, v in ns.items()}
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def parse_args(argv: Iterable[str] | None = None, prog: str = "vime train") -> VimeConfig:
    parser = build_parser(prog)
    return config_from_namespace(vars(parser.parse_args(list(argv) if argv is not None else None)), parser)


def config_dict(cfg: VimeConfig) -> dict:
    """The configuration as JSON values, its credentials redacted (VimeConfig's JSON serializer):
    the form that is stored (config.json, a batch's lineage), hashed (config_hash), shown (the
    startup log) and tracked (W&B, TensorBoard). A credential in a field (a token in rm_url's query,
    `--api-key` in vllm_extra_args) stays in the live configuration only."""
    return cfg.model_dump(mode="json")


def config_hash(cfg: VimeConfig) -> str:
    """sha256 of the resolved configuration, keys sorted; identifies batches made under it."""
    blob = json.dumps(config_dict(cfg), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def run_config_uri(storage_uri: str, run_name: str) -> str:
    """Where a run's resolved configuration is kept: `<storage>/reports/<run>/config.json`."""
    from vime_core.storage.layout import RUN_CONFIG, run_dir  # boundary: `vime train --help` (pyarrow)

    return f"{run_dir(storage_uri, run_name)}/{RUN_CONFIG}"


def dump_config(cfg: VimeConfig, path: str | Path) -> str:
    """Write the resolved configuration as JSON at `path`, a local path or a storage URI
    (`s3://...`, opened at the configuration's own S3 endpoint), in one atomic write."""
    # boundary: `vime train --help` imports this module, and vime_core.storage loads pyarrow
    from vime_core.storage.endpoint import S3Endpoint
    from vime_core.storage.fs import open_parent

    location, name = open_parent(str(path), S3Endpoint.of(cfg))
    location.put_atomic(name, (json.dumps(config_dict(cfg), indent=2, sort_keys=True) + "\n").encode())
    return location.url(name)


def read_run_config(storage_uri: str, run_name: str, endpoint=None) -> VimeConfig:
    """The configuration a run was started with (its config.json, local or in object storage;
    `endpoint`: an S3Endpoint, None for this process's environment). ConfigError names the file
    when there is none or it does not validate."""
    from vime_core.storage.fs import open_parent  # boundary: `vime train --help` (pyarrow)

    uri = run_config_uri(storage_uri, run_name)
    location, name = open_parent(uri, endpoint)
    try:
        values = json.loads(location.get(name))
    except FileNotFoundError:
        raise ConfigError(f"{uri} does not exist (no run {run_name!r} in {storage_uri}?)") from None
    return make_config(values, source=f"configuration ({uri})")


def describe(cfg: VimeConfig) -> str:
    """The resolved configuration as aligned `name = value` lines, for the log at start."""
    d = config_dict(cfg)
    width = max(len(k) for k in d)
    return "\n".join(f"{k:<{width}} = {json.dumps(v)}" for k, v in d.items())
