# rollbus tasks. `pip install -e '.[dev]'` installs `just` itself (rust-just).

set shell := ["bash", "-cu"]

# install everything needed to run and test
setup:
    python -m pip install -e '.[dev]'

# start nats-server (embedded), engine, ROLLBUS_TP ranks and the API on the defaults
run *ARGS:
    rollbus serve {{ARGS}}

# the full test suite (unit, integration, e2e) against a real nats-server
test *ARGS:
    python -m pytest -q -m "not bench and not faults" --ignore=tests/faults {{ARGS}}

# fault injection with real signals: ranks, engine and nats-server killed / stopped
faults *ARGS:
    python -m pytest -q tests/faults {{ARGS}}

# benchmarks with their baselines, same run; prints tables with ratios
bench *ARGS:
    python -m tests.bench {{ARGS}}

lint:
    ruff check shared services tests
    mypy shared
