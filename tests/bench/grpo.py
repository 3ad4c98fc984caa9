"""Asynchronous GRPO against the synchronous loop on the same task and budget
(``python -m tests.bench grpo``).

Both loops are ``examples/async_grpo`` with the same options (policy, batch of 8 prompts ×
16 samples, a version published every 2 steps, the same number of trainer steps, seed) on
a fresh ``rollbus serve`` each (TP=1, ``AUTO_UPDATE`` with pause ``keep``):

- **sync** (the baseline): generate a batch → train a step → publish → wait until the
  instance serves the new version → generate;
- **async**: rollout threads keep the instance busy while the trainer trains on the
  groups that finished (staleness ≤ about one version here) and publishes; the instance
  follows the versions without the rollout side ever stopping.

Measured per run: trainer steps per minute and rollout tokens per second (completion
tokens generated during the training loop / its wall time), each the async value over
the sync value of the same run. AReaL reports 2.77× for async over sync on its GPU
cluster; here trainer, engine and rank share the host's cores, so the gain is what
overlap buys on this machine — printed as measured.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tests.bench.common import Table

log = logging.getLogger("bench")


def run(tmp: Path, runs: int = 5, quick: bool = False) -> list[Table]:
    from examples.async_grpo.run import Options
    from examples.async_grpo.run import run as grpo_run

    steps = 16 if quick else 60
    steps_t = Table("grpo_steps", f"GRPO trainer steps/min: async vs sync ({steps} steps, "
                    "8 prompts × 16 samples, publish every 2)", "steps/min")
    tok_t = Table("grpo_tokens", "GRPO rollout tokens/s: async vs sync (same runs)", "tokens/s")
    rew_t = Table("grpo_reward", f"GRPO mean reward of the last 10 of {steps} steps "
                  "(same runs; learning, not speed)", "reward")
    rows = {}
    for t in (steps_t, tok_t, rew_t):
        rows[t.id] = (t.add("sync (generate → train → update → generate)"),
                      t.add("async (rollbus auto-update, pause keep)",
                            baseline="sync (generate → train → update → generate)"))
    for i in range(runs):
        for k, mode in enumerate(("sync", "async")):
            opts = Options(mode=mode, steps=steps, seed=i)
            res = grpo_run(opts, tmp / f"grpo-{mode}-{i}", tp=1, quiet=True, plot_png=False)
            log.info("grpo %s run %d: %.1f steps/min, %.1f tokens/s, reward %.3f -> %.3f",
                     mode, i, res.steps_per_min, res.tokens_per_s, res.reward(True),
                     res.reward(False))
            rows["grpo_steps"][k].values.append(res.steps_per_min)
            rows["grpo_tokens"][k].values.append(res.tokens_per_s)
            rows["grpo_reward"][k].values.append(res.reward(False))
    note = ("One host, 2 cores shared by the trainer (paddle), the engine, one rank and the "
            "API; AReaL's 2.77× is on GPUs where generation and training do not compete for "
            "the same cores.")
    steps_t.notes.append(note)
    for t in (steps_t, tok_t):
        ratio = t.to_json()["rows"][1]["ratio"]
        if ratio:
            print(f"GRPO async/sync {t.unit}: {ratio['median']:.2f}× (min {ratio['min']:.2f}×, "
                  f"max {ratio['max']:.2f}×, {ratio['n']} runs); AReaL reports 2.77×", flush=True)
    return [steps_t, tok_t, rew_t]
