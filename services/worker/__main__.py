import signal
import sys

# importing paddle installs paddle's own SIGTERM handler (a C++ "Traceback", an abort):
# a stop signal that comes while it loads waits until the rank's handlers are set
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

from services.worker.main import main  # noqa: E402

sys.exit(main())
