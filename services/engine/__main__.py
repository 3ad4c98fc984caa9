import sys

from services.engine.main import main

sys.exit(main())
