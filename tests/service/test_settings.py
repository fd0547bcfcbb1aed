"""Service settings from CLONECAST_* environment variables (the only place they are read)."""

from __future__ import annotations

import pytest

from service.config import ServiceSettings


def test_gil_switch_interval_defaults_and_is_validated(monkeypatch):
    monkeypatch.delenv("CLONECAST_GIL_SWITCH_MS", raising=False)
    assert ServiceSettings.from_env().gil_switch_ms == 0.5
    monkeypatch.setenv("CLONECAST_GIL_SWITCH_MS", "2")
    assert ServiceSettings.from_env().gil_switch_ms == 2.0
    for bad in ("0", "-1", "5000"):
        monkeypatch.setenv("CLONECAST_GIL_SWITCH_MS", bad)
        with pytest.raises(ValueError, match="CLONECAST_GIL_SWITCH_MS"):
            ServiceSettings.from_env()


def test_eager_flag_and_capacity(monkeypatch):
    monkeypatch.setenv("CLONECAST_EAGER", "1")
    monkeypatch.setenv("CLONECAST_MAX_NUM_SEQS", "128")
    settings = ServiceSettings.from_env()
    assert settings.cuda_graphs is False and settings.max_num_seqs == 128


def _engine_config(settings):
    """The engine configuration the service builds from `settings` (what start() uses)."""
    from service.app import Services

    return Services(settings)._engine_config("cpu")


def test_step_token_budget_defaults_to_the_batch_and_is_validated(monkeypatch):
    """CLONECAST_MAX_BATCHED_TOKENS sets the engine's token budget per step; unset it is
    max(512, max_num_seqs); a negative one is refused, one below max_num_seqs is the engine's
    configuration error (a running request could not decode)."""
    from engine import ConfigError

    monkeypatch.delenv("CLONECAST_MAX_BATCHED_TOKENS", raising=False)
    monkeypatch.setenv("CLONECAST_MAX_NUM_SEQS", "256")
    assert _engine_config(ServiceSettings.from_env(device="cpu")).max_num_batched_tokens == 512
    monkeypatch.setenv("CLONECAST_MAX_NUM_SEQS", "768")
    assert _engine_config(ServiceSettings.from_env(device="cpu")).max_num_batched_tokens == 768
    monkeypatch.setenv("CLONECAST_MAX_NUM_SEQS", "256")
    monkeypatch.setenv("CLONECAST_MAX_BATCHED_TOKENS", "1024")
    assert _engine_config(ServiceSettings.from_env(device="cpu")).max_num_batched_tokens == 1024
    monkeypatch.setenv("CLONECAST_MAX_BATCHED_TOKENS", "-1")
    with pytest.raises(ValueError, match="CLONECAST_MAX_BATCHED_TOKENS"):
        ServiceSettings.from_env()
    monkeypatch.setenv("CLONECAST_MAX_BATCHED_TOKENS", "128")
    with pytest.raises(ConfigError, match="at least max_num_seqs"):
        _engine_config(ServiceSettings.from_env(device="cpu"))


def test_serve_passes_the_step_token_budget_flag_over_the_environment(monkeypatch):
    import service.app
    from service import cli

    seen = []
    monkeypatch.setattr(service.app, "create_app", lambda settings: seen.append(settings) or 0)
    monkeypatch.setattr(cli, "_check_port", lambda host, port: None)
    monkeypatch.setenv("CLONECAST_MAX_BATCHED_TOKENS", "768")

    class Stop(Exception):  # leave serve() once the settings are built: nothing is served
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(service.app, "uvicorn_options", stop)
    for argv, want in ((["--max-batched-tokens", "1024"], 1024), ([], 768)):
        with pytest.raises(Stop):
            cli.main(["serve", "--device", "cpu", *argv])
        assert _engine_config(seen.pop()).max_num_batched_tokens == want


def test_attention_backend_is_passed_to_the_engine(monkeypatch):
    """CLONECAST_ATTENTION_BACKEND selects a FlashAttention backend where present; a bad
    value or one this machine cannot run is the engine's configuration error at start."""
    from engine import ConfigError

    monkeypatch.delenv("CLONECAST_ATTENTION_BACKEND", raising=False)
    assert ServiceSettings.from_env().attention_backend == "auto"
    monkeypatch.setenv("CLONECAST_ATTENTION_BACKEND", "torch")
    config = _engine_config(ServiceSettings.from_env(device="cpu"))
    assert config.plan_overrides["attention_backend"] == "torch"
    monkeypatch.setenv("CLONECAST_ATTENTION_BACKEND", "flash")
    settings = ServiceSettings.from_env(device="cpu")
    assert settings.attention_backend == "flash"
    with pytest.raises(ConfigError, match="needs CUDA"):  # refused when the service builds it
        _engine_config(settings)


def test_kv_cache_dtype_is_passed_to_the_engine(monkeypatch):
    """CLONECAST_KV_CACHE_DTYPE=fp8 reaches the engine's config; a bad value is the engine's
    configuration error at start, naming the choices."""
    from engine import ConfigError

    monkeypatch.delenv("CLONECAST_KV_CACHE_DTYPE", raising=False)
    assert ServiceSettings.from_env().kv_cache_dtype == "auto"
    monkeypatch.setenv("CLONECAST_KV_CACHE_DTYPE", "fp8")
    assert _engine_config(ServiceSettings.from_env(device="cpu")).kv_cache_dtype == "fp8"
    monkeypatch.setenv("CLONECAST_KV_CACHE_DTYPE", "int4")
    with pytest.raises(ConfigError, match="auto or fp8"):
        _engine_config(ServiceSettings.from_env(device="cpu"))


def test_the_wire_constants_are_the_engines():
    """The protocol's constants live where clients can import them without the engine
    (clonecast_client/wire.py); those that are engine facts must be the engine's."""
    import engine
    from clonecast_client import wire

    assert wire.DEFAULT_SAMPLE_RATE == engine.SAMPLE_RATE
    assert engine.MAX_AUDIO_SECONDS == 81.6 and engine.FRAME_MS == 40


def test_prefix_caching_can_be_turned_off(monkeypatch):
    """CLONECAST_PREFIX_CACHING=0 (or `serve --no-prefix-caching`): every prompt computed in
    full, the engine's configuration says so; on by default."""
    monkeypatch.delenv("CLONECAST_PREFIX_CACHING", raising=False)
    assert _engine_config(ServiceSettings.from_env()).enable_prefix_caching is True
    monkeypatch.setenv("CLONECAST_PREFIX_CACHING", "0")
    assert _engine_config(ServiceSettings.from_env()).enable_prefix_caching is False


def test_plan_overrides_come_from_a_json_object(monkeypatch):
    """CLONECAST_PLAN: execution-plan overrides, checked by the engine's configuration (an
    unknown field is refused there, by name); anything but a JSON object is refused here."""
    from engine import ConfigError

    monkeypatch.setenv("CLONECAST_PLAN", '{"graph_buckets": [1, 2, 4]}')
    config = _engine_config(ServiceSettings.from_env(device="cpu"))
    assert config.plan_overrides == {"graph_buckets": [1, 2, 4]}
    for bad in ("[1, 2]", "{not json"):
        monkeypatch.setenv("CLONECAST_PLAN", bad)
        with pytest.raises(ValueError, match="CLONECAST_PLAN must be a JSON object"):
            ServiceSettings.from_env()
    monkeypatch.setenv("CLONECAST_PLAN", '{"graph_bucket": [1]}')
    with pytest.raises(ConfigError, match="unknown plan override"):
        _engine_config(ServiceSettings.from_env(device="cpu"))


def test_every_variable_read_is_listed_and_documented():
    """VARIABLES is what from_env reads (nothing else) and what the module's table documents."""
    import re
    from pathlib import Path

    import service.config as config

    source = Path(config.__file__).read_text()
    read = set(re.findall(r'env(?:\.get\(|\[)"(CLONECAST_[A-Z_]+)"', source))
    assert read == set(config.VARIABLES)
    for name in config.VARIABLES:
        assert name in config.__doc__, f"{name} is not in service/config.py's table"


def test_a_config_file_sets_what_the_environment_does_and_loses_to_it(tmp_path, monkeypatch):
    from service.cli import _settings

    path = tmp_path / "clonecast.toml"
    path.write_text(
        'CLONECAST_PORT = 8801\nCLONECAST_API_KEYS = ["a", "b"]\nCLONECAST_EAGER = true\n'
        'CLONECAST_PLAN = { graph_buckets = [1, 2] }\nCLONECAST_LOG_FORMAT = "json"\n'
    )
    monkeypatch.delenv("CLONECAST_PORT", raising=False)
    monkeypatch.setenv("CLONECAST_LOG_FORMAT", "plain")  # the environment wins over the file
    settings = _settings(str(path))
    assert settings.port == 8801 and settings.api_keys == ("a", "b")
    assert settings.cuda_graphs is False and settings.plan == {"graph_buckets": [1, 2]}
    assert settings.log_format == "plain"
    assert _settings(str(path), api_keys=("c",)).api_keys == ("c",)  # and a flag over both


def test_a_bad_config_file_is_one_line_naming_the_entry(tmp_path):
    from engine import ConfigError
    from service.cli import _settings

    for text, named in (
        ("CLONECAST_PORTS = 1\n", "CLONECAST_PORTS"),
        ("x = [\n", "clonecast.toml"),
    ):
        path = tmp_path / "clonecast.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=named):
            _settings(str(path))
    with pytest.raises(ConfigError, match="missing.toml"):
        _settings(str(tmp_path / "missing.toml"))


def test_the_voice_store_is_a_file_memory_or_a_postgresql_url():
    home = {"CLONECAST_CACHE_DIR": "/srv/cc"}
    assert str(ServiceSettings.from_env(home).voice_store) == "/srv/cc/voices.sqlite3"
    assert ServiceSettings.from_env({"CLONECAST_VOICE_STORE": "memory"}).voice_store is None
    url = "postgresql://cc:pw-in-url@db:5432/voices"
    settings = ServiceSettings.from_env({"CLONECAST_VOICE_STORE": url})
    assert settings.voice_store == url and "pw-in-url" not in repr(settings)
    with pytest.raises(ValueError, match="mysql:// is not supported"):
        ServiceSettings.from_env({"CLONECAST_VOICE_STORE": "mysql://db/voices"})
