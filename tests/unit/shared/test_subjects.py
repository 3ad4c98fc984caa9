import pytest

from shared.subjects import Subjects, ckpt_published, escape_token, unescape_token


@pytest.mark.parametrize(
    "name", ["Qwen2.5-0.5B", "plain", "a b*c>d~e", "é.x", "~2E", "tabs\tand\nnewlines", "..."]
)
def test_escape_is_one_token_and_reversible(name: str) -> None:
    tok = escape_token(name)
    assert not set(tok) & set(".*> \t\n")
    assert unescape_token(tok) == name


def test_escape_keeps_normal_ids_readable() -> None:
    assert escape_token("Qwen2.5-0.5B") == "Qwen2~2E5-0~2E5B"
    assert escape_token("tiny") == "tiny"


def test_distinct_names_stay_distinct() -> None:
    assert escape_token("a.b") != escape_token("a~2Eb")
    assert escape_token("a.b") != escape_token("a_b")


def test_empty_token_rejected() -> None:
    with pytest.raises(ValueError):
        escape_token("")


def test_subject_names() -> None:
    s = Subjects("prod.eu")
    assert s.ctl("pause") == "rollbus.prod~2Eeu.ctl.pause"
    assert s.worker_ctl("stage") == "rollbus.prod~2Eeu.worker.ctl.stage"
    assert s.worker_step == "rollbus.prod~2Eeu.worker.step"
    assert s.gen == "rollbus.prod~2Eeu.gen"
    assert s.event("state") == "rollbus.prod~2Eeu.events.state"
    assert ckpt_published("Qwen2.5-0.5B") == "rollbus.ckpt.Qwen2~2E5-0~2E5B.published"
