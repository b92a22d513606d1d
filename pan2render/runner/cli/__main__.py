"""``python -m pan2render.runner.cli.main``: the pan2-render command."""

import sys

from pan2render.runner.cli.main.main import main

sys.exit(main())
