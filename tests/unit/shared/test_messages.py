import msgspec
import pytest

from shared import messages as m
from shared.errors import ControlError


def test_control_reply_json_shape() -> None:
    body = msgspec.json.decode(m.json_encode(m.ControlReply("r1", result={"is_paused": True})))
    assert body == {
        "request_id": "r1",
        "error_code": 200,
        "error_message": "",
        "result": {"is_paused": True},
    }


def test_update_args_defaults_and_types() -> None:
    a = m.decode_args(b"", m.UpdateWeightsArgs)
    assert a.version is None and a.verify_checksum is None  # None: verify if a manifest
    a = m.decode_args(b'{"version": "v3", "verify_checksum": true}', m.UpdateWeightsArgs)
    assert (a.version, a.verify_checksum) == ("v3", True)


@pytest.mark.parametrize(
    "body, needle",
    [
        (b'{"version": 3}', "version"),
        (b'{"verify_checksum": "yes"}', "verify_checksum"),
        (b'{"versoin": "v1"}', "versoin"),
        (b"{not json", "JSON"),
        (b"[1]", "object"),
    ],
)
def test_bad_update_args_are_400_naming_the_problem(body: bytes, needle: str) -> None:
    with pytest.raises(ControlError) as e:
        m.decode_args(body, m.UpdateWeightsArgs)
    assert e.value.code == 400
    assert needle in e.value.message


def test_pause_mode_validated() -> None:
    assert m.decode_args(b'{"mode": "keep"}', m.PauseArgs).mode == "keep"
    assert m.decode_args(b"{}", m.PauseArgs).mode == "abort"
    with pytest.raises(ControlError) as e:
        m.decode_args(b'{"mode": "later"}', m.PauseArgs)
    assert e.value.code == 400


@pytest.mark.parametrize(
    "tags, want",
    [
        (None, ("weight", "kv_cache")),
        ("", ("weight", "kv_cache")),
        ("weight", ("weight",)),
        ("kv_cache, weight", ("weight", "kv_cache")),
        (["kv_cache"], ("kv_cache",)),
    ],
)
def test_parse_tags(tags: object, want: tuple[str, ...]) -> None:
    assert m.parse_tags(tags) == want  # type: ignore[arg-type]


def test_unknown_tag_is_400() -> None:
    with pytest.raises(ControlError) as e:
        m.parse_tags("weight,gpu")
    assert e.value.code == 400 and "gpu" in e.value.message


def test_worker_reply_roundtrip() -> None:
    rep = m.WorkerReply(1, 422, "bad shard", {"x": 1})
    assert m.json_decode(m.json_encode(rep), type=m.WorkerReply) == rep
