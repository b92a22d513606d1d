"""``python -m pan2render.runner.cli``: the pan2-render command."""

import sys

from pan2render.runner.cli.main import main

sys.exit(main())
