"""``python -m kvalloc_cli`` runs the ``kvalloc`` command."""

import sys

from . import main

sys.exit(main())
