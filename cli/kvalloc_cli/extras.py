"""What the command needs beyond pykvalloc, which needs numpy alone: each need is an extra of
the pykvalloc distribution, and a command that lacks one says in one line how to install it."""

from __future__ import annotations

import importlib

#: (module, the extra that installs it) for each module the command imports beyond pykvalloc.
RICH = ("rich", "cli")          # every command prints with rich
TEXTUAL = ("textual", "tui")    # kvalloc top, and the demo watched live


def install_hint(need: tuple[str, str]) -> str | None:
    """None when the module of ``need`` imports; else what to install, as
    ``needs MODULE: pip install 'pykvalloc[EXTRA]'``."""
    module, extra = need
    try:
        importlib.import_module(module)
    except ImportError:
        return f"needs {module}: pip install 'pykvalloc[{extra}]'"
    return None
