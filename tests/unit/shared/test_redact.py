import pytest

from shared.errors import BusUnreachable
from shared.redact import public_path, public_url


@pytest.mark.parametrize(
    "url, shown",
    [
        ("nats://alice:s3cret@10.0.0.5:4222", "nats://10.0.0.5:4222"),
        ("tls://tok3n@nats.example:4443/path?x=1", "tls://nats.example:4443"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("nats://u:p@a:1, nats://v:q@b:2", "nats://a:1,nats://b:2"),
        ("u:p@host:4222", "nats://host:4222"),
        ("nats://u:p@[::1]:4222", "nats://[::1]:4222"),
        ("nats://u:p@host:notaport", "<redacted>"),
        ("nats://u:p@", "<redacted>"),
    ],
)
def test_public_url_keeps_only_scheme_host_port(url: str, shown: str) -> None:
    assert public_url(url) == shown
    for secret in ("alice", "s3cret", "tok3n", ":p@", ":q@"):
        assert secret not in public_url(url)


def test_bus_unreachable_message_has_no_credentials() -> None:
    e = BusUnreachable("nats://alice:s3cret@127.0.0.1:1", "OSError")
    assert "s3cret" not in e.message and "alice" not in e.message
    assert "nats://127.0.0.1:1" in e.message


def test_public_path_is_relative_or_just_the_name(tmp_path: object) -> None:
    assert public_path("/srv/m/versions/v1/rank0.safetensors", "/srv/m") == (
        "versions/v1/rank0.safetensors"
    )
    assert public_path("/elsewhere/x.safetensors", "/srv/m") == "x.safetensors"
    assert public_path("/srv/m", "/srv/m") == "."
