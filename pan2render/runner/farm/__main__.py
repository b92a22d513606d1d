"""``python -m pan2render.runner.farm``: the farm process (`service.main`), as ``farm start`` runs it."""

import sys

from pan2render.runner.farm.service import main

sys.exit(main())
