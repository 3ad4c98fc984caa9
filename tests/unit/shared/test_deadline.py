"""``Rollbus-Deadline``: the header a caller's bus stamps on a request, and the check a
serving bus makes before any handler runs (pure: the clock is passed in)."""

from __future__ import annotations

from shared.bus import DEADLINE, deadline_header, past_deadline

NOW = 1_800_000_000.0  # unix epoch seconds


def test_header_is_epoch_ms_of_now_plus_timeout() -> None:
    assert deadline_header(2.5, now=NOW) == str(int(NOW * 1000) + 2500)
    assert deadline_header(0.001, now=NOW) == str(int(NOW * 1000) + 1)


def test_negative_timeout_is_now() -> None:
    assert deadline_header(-3.0, now=NOW) == str(int(NOW * 1000))


def test_default_clock_is_the_wall_clock() -> None:
    # not monotonic: another process compares it with its own time.time()
    at = int(deadline_header(60.0))
    assert not past_deadline({DEADLINE: str(at)})
    assert past_deadline({DEADLINE: str(at - 120_000)})


def test_before_and_at_the_deadline_is_served() -> None:
    h = {DEADLINE: deadline_header(2.0, now=NOW)}
    assert past_deadline(h, now=NOW) == ""
    assert past_deadline(h, now=NOW + 1.999) == ""
    assert past_deadline(h, now=NOW + 2.0) == ""  # the caller still waits at its timeout


def test_after_the_deadline_is_dropped_and_says_how_late() -> None:
    h = {DEADLINE: deadline_header(2.0, now=NOW)}
    why = past_deadline(h, now=NOW + 2.5)
    assert why == "0.500s past its caller's deadline"


def test_no_header_is_served_as_before() -> None:
    # the nats CLI or a raw client sends none
    assert past_deadline({}, now=NOW) == ""
    assert past_deadline({"Rollbus-Request-Id": "x"}, now=NOW) == ""


def test_unreadable_deadline_is_not_served() -> None:
    for bad in ("", "soon", "1.5e12", "0x10", "１２"):
        why = past_deadline({DEADLINE: bad}, now=NOW)
        if bad == "１２":  # int() reads unicode digits: 12 ms, long past
            assert "past its caller's deadline" in why
        else:
            assert why.startswith("unreadable Rollbus-Deadline"), (bad, why)


def test_surrounding_spaces_are_read() -> None:
    at = deadline_header(1.0, now=NOW)
    assert past_deadline({DEADLINE: f" {at} "}, now=NOW) == ""
