# rollbus tasks. `pip install -e '.[dev]'` installs `just` itself (rust-just).

set shell := ["bash", "-cu"]

# install everything needed to run and test
setup:
    python -m pip install -e '.[dev]'

# Quiet (`@`, no-exit-message): the output is exactly `rollbus serve`'s, so a start-up
# error stays its one line (just would add `rollbus serve` and `error: recipe … failed`).

# start nats-server (embedded), engine, ROLLBUS_TP ranks and the API on the defaults
[no-exit-message]
run *ARGS:
    @rollbus serve {{ARGS}}

# the full test suite (unit, integration, e2e) against a real nats-server
test *ARGS:
    python -m pytest -q -m "not bench and not faults" --ignore=tests/compat --ignore=tests/faults --ignore=tests/fleet {{ARGS}}

# fault injection with real signals: ranks, engine and nats-server killed / stopped
faults *ARGS:
    python -m pytest -q tests/faults {{ARGS}}

# a fleet of three instances on one external nats-server, updated as one transaction
fleet *ARGS:
    python -m pytest -q tests/fleet -p no:randomly {{ARGS}}

# equality with transformers (needs torch): installs a CPU torch and transformers, runs
# tests/compat. The plain pin resolves from a local wheel on our machines; elsewhere the
# CPU torch comes from PyTorch's CPU index (never a CUDA build by accident).
compat *ARGS:
    python -m pip install -q 'torch==2.13.0+cpu' transformers 2>/dev/null || { python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu && python -m pip install -q transformers; }
    python -m pytest -q tests/compat {{ARGS}}

# asynchronous GRPO on rollbus (examples/async_grpo): starts `rollbus serve` itself (free
# ports, own DATA_DIR) and writes metrics.csv + reward.png to .data/examples/async_grpo
example *ARGS:
    python -m examples.async_grpo {{ARGS}}

# benchmarks with their baselines, same run; prints tables with ratios (the generation
# baseline is transformers on a CPU torch, installed as `just compat` does)
bench *ARGS:
    python -m pip install -q 'torch==2.13.0+cpu' transformers 2>/dev/null || { python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu && python -m pip install -q transformers; }
    python -m tests.bench {{ARGS}}

lint:
    ruff check shared services tests
    lint-imports --no-cache --no-logo
    mypy shared

# rollbus on a 3-node NATS cluster (infra/nats/cluster-*.conf), nodes killed under load
cluster *ARGS:
    ROLLBUS_CLUSTER_TESTS=1 python -m pytest -q tests/cluster -p no:randomly {{ARGS}}

# rewrite the README's benchmark section from bench.json (written by `just bench`)
bench-readme:
    python -m tests.bench.report bench.json --readme README.md
