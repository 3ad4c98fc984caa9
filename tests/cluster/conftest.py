"""The 3-node cluster tests are slow: only `just cluster` (ROLLBUS_CLUSTER_TESTS=1) runs them."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("ROLLBUS_CLUSTER_TESTS") else ["test_*.py"]
