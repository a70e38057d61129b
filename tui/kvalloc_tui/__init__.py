"""kvalloc_tui: ``kvalloc top``, a live inspector of libkvalloc pools, built on Textual.

It attaches to a running engine only through the pool's shared-memory statistics segment
(``pykvalloc.stats``): nothing is injected into the engine and nothing is sent to it.

``kvalloc_tui.app.KvallocTop`` is the app; ``kvalloc_tui.render`` draws a snapshot's figures
as rich text, and is also what ``kvalloc dump`` prints with (it does not load Textual). The app
needs Textual and the rendering rich: the ``tui`` extra of pykvalloc installs both.
"""
