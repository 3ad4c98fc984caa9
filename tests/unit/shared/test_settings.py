import pytest
from pydantic import ValidationError

from shared.settings import Settings, describe_error


def test_defaults_match_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(__import__("os").environ):
        if k.startswith("ROLLBUS_"):
            monkeypatch.delenv(k)
    s = Settings()
    assert (s.nats_url, s.instance, s.api_host, s.api_port, s.tp) == (
        "",
        "default",
        "127.0.0.1",
        8000,
        2,
    )
    assert s.embedded_nats and s.dynamic_load_weight and not s.auto_update
    assert str(s.model_dir).endswith("models/tiny")
    assert s.served_model_name == "tiny"


@pytest.mark.parametrize(
    "alias, want",
    [
        ("rsync", "object_store"),
        ("ipc_snapshot", "snapshot"),
        ("ipc", "ipc"),
        ("OBJECT_STORE", "object_store"),
    ],
)
def test_fastdeploy_strategy_aliases(
    monkeypatch: pytest.MonkeyPatch, alias: str, want: str
) -> None:
    monkeypatch.setenv("ROLLBUS_LOAD_STRATEGY", alias)
    assert Settings().load_strategy == want


def test_bad_setting_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBUS_TP", "two")
    with pytest.raises(ValidationError) as e:
        Settings()
    line = describe_error(e.value)
    assert "\n" not in line and "ROLLBUS_TP" in line and "'two'" in line


def test_to_env_roundtrip(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings(tp=3, instance="x", auto_update=True)
    for k, v in s.to_env().items():
        monkeypatch.setenv(k, v)
    again = Settings()
    assert again.tp == 3 and again.instance == "x" and again.auto_update is True


@pytest.mark.parametrize("value", ["0", "0.01", "0.049", "61"])
def test_rank_refresh_out_of_bounds_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """Below 50 ms the status scatter would keep both ranks' event loops busy."""
    monkeypatch.setenv("ROLLBUS_RANK_REFRESH_S", value)
    with pytest.raises(ValidationError) as e:
        Settings()
    msg = describe_error(e.value)
    assert "RANK_REFRESH_S" in msg and "\n" not in msg, msg
    monkeypatch.setenv("ROLLBUS_RANK_REFRESH_S", "0.05")
    assert Settings().rank_refresh_s == 0.05


@pytest.mark.parametrize(
    "var", ["CONTROL_TIMEOUT_S", "STALL_S", "RESTART_WINDOW_S", "BODY_TIMEOUT_S", "ADMIT_WAIT_MS"]
)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_float_setting_not_finite_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    """``inf`` passed ``gt=0`` and the launcher died on ``int(2 * inf)`` with a traceback."""
    monkeypatch.setenv(f"ROLLBUS_{var}", value)
    with pytest.raises(ValidationError) as e:
        Settings()
    line = describe_error(e.value)
    assert "\n" not in line and f"ROLLBUS_{var}" in line


@pytest.mark.parametrize("value", ["", "a.b", "a b", "ckpt>", "*", "ckpt/x", "ü"])
def test_ckpt_bucket_not_a_nats_bucket_name_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """A bucket name becomes the stream ``OBJ_<bucket>`` and subjects ``$O.<bucket>.>``:
    a dot, a space or a wildcard would only fail later, at the engine's bucket creation."""
    monkeypatch.setenv("ROLLBUS_CKPT_BUCKET", value)
    with pytest.raises(ValidationError) as e:
        Settings()
    line = describe_error(e.value)
    assert "\n" not in line and "ROLLBUS_CKPT_BUCKET" in line


@pytest.mark.parametrize("value", ["rollbus_ckpt", "ckpt-2", "A9"])
def test_ckpt_bucket_valid_names_pass(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ROLLBUS_CKPT_BUCKET", value)
    assert Settings().ckpt_bucket == value


@pytest.mark.parametrize("value", [".", "..", "a\tb"])
def test_model_name_not_a_model_id_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """The served model id is the ``<model>`` dir the ``ipc`` strategy reads a version
    from: ``..`` would point the ranks outside IPC_DIR (the trainer refuses that id)."""
    monkeypatch.setenv("ROLLBUS_MODEL_NAME", value)
    with pytest.raises(ValidationError) as e:
        Settings()
    line = describe_error(e.value)
    assert "\n" not in line and "ROLLBUS_MODEL_NAME" in line


def test_negative_seed_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's weights come from ``numpy``'s generator, which takes no negative
    seed: ``ROLLBUS_SEED=-1`` was a traceback from ``rollbus serve`` after nats started."""
    monkeypatch.setenv("ROLLBUS_SEED", "-1")
    with pytest.raises(ValidationError) as e:
        Settings()
    line = describe_error(e.value)
    assert "\n" not in line and "ROLLBUS_SEED" in line


def test_api_port_zero_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher probes ``API_HOST:API_PORT/health`` for readiness: with port 0 the API
    listened on a random port and the stack never said ready (no error either)."""
    monkeypatch.setenv("ROLLBUS_API_PORT", "0")
    with pytest.raises(ValidationError) as e:
        Settings()
    assert "ROLLBUS_API_PORT" in describe_error(e.value)


@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_api_host_is_refused(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    """An empty host binds every interface; only an explicit 0.0.0.0 / :: may do that."""
    monkeypatch.setenv("ROLLBUS_API_HOST", host)
    with pytest.raises(ValidationError) as e:
        Settings()
    assert "ROLLBUS_API_HOST" in describe_error(e.value)


@pytest.mark.parametrize(
    "url", ["nats://svc:s3cr/et@nats.example:4222", "nats://svc:s3cr#et@nats.example:4222"]
)
def test_a_bad_nats_url_is_refused_without_its_password(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    # an unencoded '/' or '#' in a password ends the URL's authority there: urlsplit
    # then reads the password's start as the port and quotes it in its ValueError
    monkeypatch.setenv("ROLLBUS_NATS_URL", url)
    with pytest.raises(ValidationError) as e:
        Settings()
    line = describe_error(e.value)
    assert "ROLLBUS_NATS_URL" in line
    assert "s3cr" not in line
