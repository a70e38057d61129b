"""``python -m pykvalloc`` runs the ``kvalloc`` command."""

import sys

from .cli import main

sys.exit(main())
