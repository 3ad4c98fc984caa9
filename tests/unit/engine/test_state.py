import pytest

from services.engine.state import EngineState, State
from shared.errors import ControlError


def test_pause_resume_idempotent() -> None:
    s = EngineState()
    assert not s.is_paused
    assert s.pause("abort") is True
    assert s.pause("keep") is False and s.pause_mode == "abort"
    assert s.is_paused
    assert s.resume() is True and not s.is_paused
    assert s.resume() is False


def test_update_requires_pause() -> None:
    s = EngineState()
    with pytest.raises(ControlError) as e:
        s.begin_update()
    assert e.value.code == 409
    s.pause("abort")
    s.begin_update()
    assert s.state is State.UPDATING and s.is_paused
    with pytest.raises(ControlError):
        s.begin_update()
    with pytest.raises(ControlError):
        s.resume()
    with pytest.raises(ControlError):
        s.pause("abort")
    s.end_update("v2")
    assert s.state is State.PAUSED and s.weight_version == "v2"


def test_failed_update_keeps_version() -> None:
    s = EngineState(weight_version="v1")
    s.pause("abort")
    s.begin_update()
    s.end_update(None)
    assert s.weight_version == "v1" and s.state is State.PAUSED


def test_sleep_wakeup_partial_and_full() -> None:
    s = EngineState()
    s.pause("abort")
    s.sleep(("weight", "kv_cache"))
    assert s.state is State.SLEEPING and s.is_paused
    with pytest.raises(ControlError) as e:
        s.resume()
    assert e.value.code == 409
    s.begin_update()  # a sleeping engine accepts update_weights ...
    assert s.state is State.UPDATING
    with pytest.raises(ControlError):
        s.check_wakeup(("weight",), use_cudagraph=False)
    s.end_update("v9")  # ... records the version and goes back to sleep
    assert s.state is State.SLEEPING and s.weight_version == "v9"
    s.begin_update()
    s.end_update(None)  # a failed one too, on the version it had
    assert s.state is State.SLEEPING and s.weight_version == "v9"
    assert s.asleep == {"weight", "kv_cache"}
    assert s.woke(("kv_cache",)) is False and s.state is State.SLEEPING
    assert s.woke(("weight",)) is True and s.state is State.RUNNING


def test_cudagraph_wakeup_rule() -> None:
    s = EngineState()
    s.sleep(("weight", "kv_cache"))
    with pytest.raises(ControlError) as e:
        s.check_wakeup(("weight",), use_cudagraph=True)
    assert e.value.code == 400
    s.check_wakeup(("weight",), use_cudagraph=False)
    s.check_wakeup(("weight", "kv_cache"), use_cudagraph=True)


def test_cudagraph_weight_after_kv_woke_first() -> None:
    s = EngineState()
    s.sleep(("weight", "kv_cache"))
    s.check_wakeup(("kv_cache",), use_cudagraph=True)
    s.woke(("kv_cache",))
    s.check_wakeup(("weight",), use_cudagraph=True)  # KV already back: allowed


def test_check_update_changes_nothing() -> None:
    s = EngineState()
    with pytest.raises(ControlError):
        s.check_update()
    s.pause("keep")
    s.check_update()
    assert s.state is State.PAUSED
