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
    python -m pytest -q -m "not bench" {{ARGS}}

# benchmarks with their baselines, same run; prints tables with ratios
bench *ARGS:
    python -m tests.bench {{ARGS}}

lint:
    ruff check shared services tests
    mypy shared

# rewrite the README's benchmark section from bench.json (written by `just bench`)
bench-readme:
    python -m tests.bench.report bench.json --readme README.md
