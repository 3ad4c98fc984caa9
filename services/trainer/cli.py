"""``rollbus publish`` / ``rollbus versions`` (the checkpoint distribution issue)."""

from __future__ import annotations

import argparse
import sys

from shared.settings import Settings


def run(args: argparse.Namespace, settings: Settings) -> int:
    print(f"rollbus {args.cmd}: not implemented yet (checkpoint distribution)", file=sys.stderr)
    return 2
