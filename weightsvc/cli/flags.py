"""The flags of `weightsvc serve`, generated from `Settings`.

Each field of `Settings` is a flag `--field-name`, documented with the field's description, default
and `WEIGHTSVC_FIELD_NAME` variable. Values given on the command line are passed to `Settings`;
everything else (variables, defaults) is read by `Settings` itself, so there is one reading of the
environment and one set of defaults. Secrets (the role tokens) come from the environment only.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Annotated, Any, Union, get_args, get_origin

import typer
from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo

from weightsvc.settings import Settings

# Help panels of `serve --help`; a field named in none of them is listed under "Options".
PANELS = {
    "Export": ("format", "rounding", "seed", "scaling", "fp8_pattern", "device", "retain", "allow_nonfinite"),
    "Limits": ("chunk_bytes", "max_message_bytes", "max_version_bytes", "max_staged_bytes", "max_tensors",
               "max_tensor_bytes", "max_pushes", "max_models", "max_connections",
               "connect_timeout_s", "max_pulls", "max_rss_bytes", "push_idle_timeout_s",
               "push_min_bytes_per_s", "client_forget_s",
               "pull_stall_timeout_s", "push_rank_timeout_s"),
    "Auth and TLS": ("auth_file", "auth_open_paths", "tls_cert", "tls_key"),
    "Scale-out": ("redis_url", "redis_prefix", "replica_id", "replication", "advertise_host", "relay_from"),
    "Object store": ("object_store", "object_store_required", "full_every", "object_store_queue"),
}
_PANEL_OF = {name: panel for panel, names in PANELS.items() for name in names}


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_var(field: str) -> str:
    return (Settings.model_config.get("env_prefix", "") + field).upper()


def value_type(annotation: Any) -> Any:
    """`int` of `int | None`: the type a flag parses."""
    if get_origin(annotation) in (Union, types.UnionType):
        (inner,) = [a for a in get_args(annotation) if a is not type(None)]
        return inner
    return annotation


def env_only(info: FieldInfo) -> bool:
    """Secrets: a command line is visible to every user of the machine (ps, /proc)."""
    return value_type(info.annotation) is SecretStr


def flag_fields() -> dict[str, FieldInfo]:
    """The fields of `Settings` that are flags of `serve`, in declaration order."""
    return {name: info for name, info in Settings.model_fields.items() if not env_only(info)}


def flag_default(info: FieldInfo) -> Any:
    """The default a flag shows in `serve --help`: the field's (None: no default, or computed at start)."""
    return None if info.default_factory is not None else info.default


def _parameter(name: str, info: FieldInfo) -> inspect.Parameter:
    parsed = value_type(info.annotation)
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    choices = extra.get("choices")
    factory = info.default_factory
    option = typer.Option(
        f"{flag(name)}/--no-{flag(name)[2:]}" if parsed is bool else flag(name),
        envvar=env_var(name),  # shown in --help and type-checked here; Settings reads it
        help=info.description,
        # a computed default is described by its function's docstring
        show_default=(factory.__doc__ or "computed at start").strip() if factory else info.default is not None,
        metavar="[" + "|".join(str(c) for c in choices) + "]" if isinstance(choices, list) else None,
        rich_help_panel=_PANEL_OF.get(name),
    )
    # Only values given on the command line reach Settings (see settings_command): this default
    # is the one shown, never one applied.
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=flag_default(info),
                             annotation=Annotated[parsed | None, option])


def settings_command(run: Callable[[Settings], None]) -> Callable[..., None]:
    """A function whose keyword parameters are the flags of the settings, for `app.command()`:
    it builds `Settings` from the flags given and calls `run` with them."""

    def command(ctx: typer.Context, **values: Any) -> None:
        given = {k: v for k, v in values.items() if _source(ctx, k) == "COMMANDLINE"}
        run(settings_from_flags(given))

    context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [context, *(_parameter(name, info) for name, info in flag_fields().items())], return_annotation=None
    )
    command.__doc__ = run.__doc__
    return command


def _source(ctx: typer.Context, name: str) -> str | None:
    source = ctx.get_parameter_source(name)
    return None if source is None else source.name


def settings_from_flags(given: dict[str, Any]) -> Settings:
    """`Settings` of the flags given on the command line, the `WEIGHTSVC_*` variables and the
    defaults. A bad value raises `typer.BadParameter` naming the flag (and the variable it came from)."""
    try:
        return Settings(**given)
    except ValidationError as e:
        first = e.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        if not first["loc"]:  # a rule across fields; its message names the flags
            raise typer.BadParameter(message) from None
        name = str(first["loc"][0])
        hint = f"'{flag(name)}'" if name in given else f"'{flag(name)}' (env var: '{env_var(name)}')"
        if first["type"] != "value_error":  # pydantic's own messages do not say what they were given
            message += f" (got {first['input']})"
        raise typer.BadParameter(message, param_hint=hint) from None
