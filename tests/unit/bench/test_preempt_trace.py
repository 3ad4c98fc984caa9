"""``preempt_trace.analyse``: a compute thread's preempted time goes to whoever took its
CPU, and for the stack's own processes, the overlap with the other compute thread on a CPU."""

from __future__ import annotations

from tests.bench.preempt_trace import analyse


def sw(ts: float, prev: int, state: str, nxt: int) -> str:
    return (
        f"   {ts:.6f}: sched:sched_switch: prev_comm=python prev_pid={prev} prev_prio=120 "
        f"prev_state={state} ==> next_comm=python next_pid={nxt} next_prio=120"
    )


def test_preempted_time_by_culprit_and_the_other_threads_overlap() -> None:
    a, b, engine, foreign = 10, 11, 20, 99
    trace = "\n".join(
        [
            sw(0.0, 1, "S", a),  # a on CPU 0
            sw(0.0, 2, "S", b),  # b on CPU 1
            sw(1.0, a, "R", engine),  # the engine preempts a for 0.5 s; b runs meanwhile
            sw(1.5, engine, "S", a),
            sw(2.0, b, "R+", foreign),  # something else preempts b for 1 s
            sw(3.0, foreign, "S", b),
            sw(4.0, a, "S", 1),  # a sleeps (not preempted): not counted
            sw(4.2, 1, "S", a),
            sw(5.0, b, "R", engine),  # the engine preempts b while a runs 5.0-5.1 only
            sw(5.1, a, "R", foreign),
            sw(5.4, engine, "S", b),
        ]
    )
    r = analyse(trace, [a, b], {engine: "engine", a: "compute", b: "compute"})
    assert r["preempted_s"] == {"engine": 0.9, "foreign": 1.0}
    assert r["preemptions"] == {"engine": 2, "foreign": 1}
    assert r["by_stack_s"] == 0.9
    # b on CPU all of a's 0.5 s; a on CPU 0.1 of b's 0.4 s
    assert r["by_stack_other_on_cpu_s"] == 0.6
