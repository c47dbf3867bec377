"""`python -m jex.tasks.execution.engine_host serve LAUNCH`: one slot's engine host (`server.main`)."""

import sys

from jex.tasks.execution.engine_host.server import main

sys.exit(main(sys.argv[1:]))
