"""The update_weights protocol against scripted ranks: all ranks switch or none."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from services.engine import control
from services.engine.ranks import RankError
from services.engine.state import EngineState, State
from shared import messages as m


class ScriptedRanks:
    """Stands in for services.engine.ranks.Ranks: records calls, fails where told."""

    def __init__(self, fail: dict[str, tuple[int, str]] | None = None) -> None:
        self.fail = fail or {}
        self.calls: list[tuple[str, Any]] = []
        self.broadcasts: list[tuple[str, Any]] = []
        self.refreshes = 0
        self.order: list[str] = []  # "call stage", "broadcast finalize", "refresh", ...

    async def call(
        self, method: str, args: msgspec.Struct | None = None, **_: Any
    ) -> dict[int, m.WorkerReply]:
        self.calls.append((method, args))
        await asyncio.sleep(0)
        self.order.append(f"call {method}")  # every rank answered (or failed)
        if method in self.fail:
            code, msg = self.fail[method]
            raise RankError(code, msg, {0: m.WorkerReply(0, result={"rank": 0})})
        return {r: m.WorkerReply(r, result={"rank": r, "bytes": 10}) for r in range(2)}

    async def broadcast(self, method: str, args: msgspec.Struct | None = None) -> None:
        self.broadcasts.append((method, args))
        self.order.append(f"broadcast {method}")

    async def refresh(self, timeout: float | None = None) -> None:
        self.refreshes += 1  # the engine's view of the ranks asked anew
        self.order.append("refresh")


def engine(ranks: ScriptedRanks) -> Any:
    async def nothing(*_: Any, **__: Any) -> None:
        return None

    state = EngineState(weight_version="v0")
    state.pause("keep")
    return SimpleNamespace(
        state=state,
        ranks=ranks,
        latest_published="",
        settings=SimpleNamespace(load_strategy="snapshot", model_dir="/nonexistent"),
        scheduler=SimpleNamespace(weights_changed=lambda v: None, quiet=contextlib.nullcontext),
        state_changed=nothing,
        event=nothing,
    )


def run(eng: Any, version: str = "v1") -> Any:
    return asyncio.run(control.update_weights(eng, m.UpdateWeightsArgs(version=version)))


def test_success_commits_then_finalizes_with_one_update_id() -> None:
    ranks = ScriptedRanks()
    eng = engine(ranks)
    out = run(eng)
    assert out["version"] == "v1" and eng.state.weight_version == "v1"
    assert [c[0] for c in ranks.calls] == ["stage", "commit"]
    uid = ranks.calls[0][1].update_id
    assert uid and ranks.calls[1][1].update_id == uid
    assert ranks.broadcasts == [("finalize", m.UpdateIdArgs(uid))]
    assert eng.state.state is State.PAUSED


def test_stage_failure_aborts_and_never_commits() -> None:
    ranks = ScriptedRanks({"stage": (422, "rank 1: shard corrupt")})
    eng = engine(ranks)
    with pytest.raises(RankError) as e:
        run(eng)
    assert e.value.code == 422 and "rank 1" in e.value.message
    assert [c[0] for c in ranks.calls] == ["stage", "abort"]
    assert ranks.broadcasts == []
    assert eng.state.weight_version == "v0" and eng.state.state is State.PAUSED


def test_commit_failure_rolls_back_every_rank() -> None:
    ranks = ScriptedRanks({"commit": (503, "commit: ranks [1] did not answer")})
    eng = engine(ranks)
    with pytest.raises(RankError) as e:
        run(eng)
    assert e.value.code == 503 and "[1]" in e.value.message and "rolled back" in e.value.message
    uid = ranks.calls[0][1].update_id
    assert ranks.calls[2] == ("rollback", m.UpdateIdArgs(uid)) and ranks.broadcasts == []
    assert eng.state.weight_version == "v0" and eng.state.state is State.PAUSED


@pytest.mark.parametrize(("failed", "undo"), [("stage", "abort"), ("commit", "rollback")])
@pytest.mark.parametrize("undo_fails", [False, True])
def test_abort_and_rollback_are_answered_before_the_view_is_refreshed(
    failed: str, undo: str, undo_fails: bool
) -> None:
    """After a failed step the ranks' abort / rollback answers are awaited (not a
    fire-and-forget broadcast) before the refresh that ends the update: ``status`` then
    shows the ranks rolled back. Their own failure (a rank silent) is logged, never
    replaces the step's error, and the refresh still follows."""
    fail = {failed: (503, f"{failed}: ranks [1] did not answer")}
    if undo_fails:
        fail[undo] = (503, f"{undo}: ranks [1] did not answer within 2s")
    ranks = ScriptedRanks(fail)
    eng = engine(ranks)
    with pytest.raises(RankError) as e:
        run(eng)
    assert e.value.message.startswith(failed), e.value.message
    steps = ["call stage"] + (["call commit"] if failed == "commit" else [])
    assert ranks.order == [*steps, f"call {undo}", "refresh"], ranks.order
    assert eng.state.weight_version == "v0" and eng.state.state is State.PAUSED


def test_update_needs_pause_and_a_version() -> None:
    eng = engine(ScriptedRanks())
    eng.state.resume()
    with pytest.raises(Exception) as e:
        run(eng)
    assert getattr(e.value, "code", None) == 409
    eng.state.pause("abort")
    with pytest.raises(Exception) as e:
        asyncio.run(control.update_weights(eng, m.UpdateWeightsArgs()))
    assert getattr(e.value, "code", None) == 404
    assert eng.state.state is State.PAUSED  # not left in "updating"


@pytest.mark.parametrize("fail", [None, "stage", "commit"])
def test_the_ranks_view_is_refreshed_before_the_update_answers(fail: str | None) -> None:
    """``status`` right after update_weights shows its outcome on every rank: the view is
    asked anew at the end of the update, whatever the outcome."""
    ranks = ScriptedRanks({fail: (503, f"{fail}: ranks [1] did not answer")} if fail else {})
    eng = engine(ranks)
    with contextlib.suppress(RankError):
        run(eng)
    assert ranks.refreshes == 1
