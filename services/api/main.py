"""The API process: ``python -m services.api`` (uvicorn serving :func:`create_app`)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from services.api.app import create_app
from shared.settings import settings_or_exit


def main() -> int:
    settings = settings_or_exit("rollbus-api")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s api %(levelname)s %(name)s: %(message)s",
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.api_host,
        port=settings.api_port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,  # open streams end then: the whole stop is < 10 s
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    except SystemExit as e:
        return int(e.code or 0)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
