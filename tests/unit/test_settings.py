"""`weightsvc serve` takes its flags from `Settings`: every field a flag, one set of defaults, one reading
of the environment; and the choices Settings accepts are the ones the rounding package implements."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import SecretStr
from typer.testing import CliRunner

from weightsvc import rounding
from weightsvc.cli import flags
from weightsvc.cli._common import DEFAULT_TARGET
from weightsvc.cli.main import app
from weightsvc.settings import Settings


def serve_app() -> tuple[typer.Typer, list[Settings]]:
    """The generated `serve` command, with a `run` that keeps the settings instead of serving."""
    seen: list[Settings] = []
    one = typer.Typer(add_completion=False)
    one.command("serve")(flags.settings_command(seen.append))
    return one, seen


def invoke(args: list[str], env: dict[str, str] | None = None) -> Settings:
    one, seen = serve_app()
    result = CliRunner().invoke(one, args, env=env)
    assert result.exit_code == 0, result.output
    (settings,) = seen
    return settings


def serve_options() -> dict[str, Any]:
    """The options of `weightsvc serve`, as the command line builds them."""
    command = typer.main.get_command(app).get_command(typer.Context(typer.main.get_command(app)), "serve")
    return {p.name: p for p in command.params if p.name != "ctx"}


def test_every_field_is_a_flag_with_its_default_help_and_variable() -> None:
    options = serve_options()
    secrets = {n for n, f in Settings.model_fields.items() if f.annotation == SecretStr | None}
    assert secrets == {"pull_tokens", "push_tokens", "admin_tokens"}
    assert set(options) == set(Settings.model_fields) - secrets  # tokens: environment only
    for name, field in Settings.model_fields.items():
        if name in secrets:
            continue
        option = options[name]
        assert f"--{name.replace('_', '-')}" in option.opts, name
        assert option.envvar == f"WEIGHTSVC_{name.upper()}"
        assert option.help and option.help == field.description, name
        if field.default_factory is None:
            assert option.default == field.default, name
        else:  # computed at start: shown in words, never applied by the command line
            assert option.default is None and option.show_default == field.default_factory.__doc__.strip()


def test_flag_names_users_know_stay() -> None:
    opts = {o for option in serve_options().values() for o in option.opts}
    assert {"--grpc-port", "--http-port", "--data-dir", "--redis-url", "--format", "--rounding", "--device",
            "--retain", "--relay-from", "--max-pushes", "--max-rss-bytes", "--allow-nonfinite"} <= opts


def a_different_value(name: str, field: Any, tmp_path: Path) -> tuple[list[str], Any]:
    """Flags that set the field to a valid value other than its default, and that value."""
    flag = f"--{name.replace('_', '-')}"
    kind = flags.value_type(field.annotation)
    extra = field.json_schema_extra or {}
    if "choices" in extra:
        value = next(c for c in extra["choices"] if c != field.default)
    elif kind is bool:
        return [flag if not field.default else f"--no-{flag[2:]}"], not field.default
    elif kind is int:
        value = 12345 if field.default_factory else field.default + 1
        if name.endswith("_port"):
            value = 0
    elif kind is float:
        value = field.default + 1.5
    elif kind is Path:
        value = tmp_path / name
    else:
        value = f"{name}-given"
    return [flag, str(value)], value


def test_each_flag_reaches_its_field(tmp_path: Path) -> None:
    for name in serve_options():
        args, value = a_different_value(name, Settings.model_fields[name], tmp_path)
        if name in ("tls_cert", "tls_key"):  # the two go together
            args += ["--tls-key" if name == "tls_cert" else "--tls-cert", str(tmp_path / "other")]
        settings = invoke(args)
        assert getattr(settings, name) == value, (name, args)


def test_flags_win_over_variables_and_variables_over_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WEIGHTSVC_RETAIN", "WEIGHTSVC_ROUNDING", "WEIGHTSVC_MAX_PULLS"):
        monkeypatch.delenv(var, raising=False)
    settings = invoke(["--retain", "7"], env={"WEIGHTSVC_RETAIN": "3", "WEIGHTSVC_ROUNDING": "ef"})
    assert (settings.retain, settings.rounding, settings.max_pulls) == (7, "ef", Settings().max_pulls)
    # what no flag or variable sets is exactly Settings' own default, computed ones included
    assert invoke([]).model_dump() == Settings().model_dump()


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--rounding", "nearest"], {}, "Invalid value for '--rounding': unknown rounding 'nearest'; choose one of"),
        (["--retain", "0"], {}, "Invalid value for '--retain': Input should be greater than or equal to 1 (got 0)"),
        ([], {"WEIGHTSVC_HTTP_PORT": "70000"}, "Invalid value for '--http-port' (env var: 'WEIGHTSVC_HTTP_PORT')"),
        (["--tls-cert", "cert.pem"], {}, "--tls-cert and --tls-key go together"),
        (["--object-store-required", "--redis-url", "redis://r:6379/0"], {},
         "--object-store-required is a single server's: sharded replicas (--redis-url) publish a version once"),
        (["--device", "tpu"], {}, "Invalid value for '--device': unknown device 'tpu'; choose one of auto, cpu, cuda"),
        ([], {"WEIGHTSVC_DEVICE": "gpu"}, "unknown device 'gpu'; choose one of auto, cpu, cuda"),
    ],
)
def test_a_bad_value_names_its_flag(args: list[str], env: dict[str, str], expected: str) -> None:
    one, seen = serve_app()
    result = CliRunner().invoke(one, args, env=env, standalone_mode=False)
    assert isinstance(result.exception, typer.BadParameter) and not seen
    assert expected in result.exception.format_message()


def test_the_choices_are_what_the_rounding_package_implements() -> None:
    # The microscaled formats are numerics only until the service stages them (packed FP4, block scales).
    fields = Settings.model_fields
    choices = {name: fields[name].json_schema_extra["choices"]  # type: ignore[index]
               for name in ("format", "rounding", "scaling", "device")}
    assert choices == {"format": list(rounding.FORMATS), "rounding": list(rounding.ROUNDINGS),
                       "scaling": list(rounding.SCALINGS), "device": list(rounding.DEVICES)}
    assert fields["fp8_pattern"].default == rounding.DEFAULT_FP8_PATTERN


def test_push_pull_and_status_default_to_the_same_target() -> None:
    group = typer.main.get_command(app)
    ctx = typer.Context(group)
    for name in ("push", "pull", "status"):
        command = group.get_command(ctx, name)  # type: ignore[attr-defined]
        (target,) = [p for p in command.params if p.name == "target"]
        assert (target.default, target.envvar) == (DEFAULT_TARGET, "WEIGHTSVC_TARGET"), name
    assert f"127.0.0.1:{Settings.model_fields['grpc_port'].default}" == DEFAULT_TARGET
