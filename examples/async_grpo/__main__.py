import sys

from examples.async_grpo.run import main

sys.exit(main())
