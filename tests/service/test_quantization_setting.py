"""The FP8 weight option through the service: CLONECAST_QUANTIZATION and `clonecast serve
--quantization` reach the engine's configuration; bf16 stays the default."""

from __future__ import annotations

import pytest

from service.config import ServiceSettings


def _engine_config(settings):
    from service.app import Services

    return Services(settings)._engine_config("cpu")


def test_the_environment_variable_reaches_the_engine(monkeypatch):
    from engine import ConfigError

    monkeypatch.delenv("CLONECAST_QUANTIZATION", raising=False)
    assert _engine_config(ServiceSettings.from_env(device="cpu")).quantization == "none"
    monkeypatch.setenv("CLONECAST_QUANTIZATION", "fp8")
    assert _engine_config(ServiceSettings.from_env(device="cpu")).quantization == "fp8"
    monkeypatch.setenv("CLONECAST_QUANTIZATION", "int4")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        _engine_config(ServiceSettings.from_env(device="cpu"))


def test_serve_passes_the_flag_and_refuses_unknown_values(monkeypatch, capsys):
    import service.app
    from service import cli

    seen = []
    monkeypatch.setattr(service.app, "create_app", lambda settings: seen.append(settings) or 0)
    monkeypatch.setattr(cli, "_check_port", lambda host, port: None)
    monkeypatch.delenv("CLONECAST_QUANTIZATION", raising=False)

    class Stop(Exception):  # leave serve() once the settings are built: nothing is served
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(service.app, "uvicorn_options", stop)
    for argv, want in ((["--quantization", "fp8"], "fp8"), ([], "none")):
        with pytest.raises(Stop):
            cli.main(["serve", "--device", "cpu", *argv])
        assert seen.pop().quantization == want
    with pytest.raises(SystemExit):
        cli.main(["serve", "--quantization", "int8"])
    assert "invalid choice" in capsys.readouterr().err
