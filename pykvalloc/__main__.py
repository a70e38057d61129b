"""``python -m pykvalloc`` says where the command is: ``kvalloc`` is a package of its own,
``kvalloc_cli``, built on this one, which never imports it."""

import sys

sys.exit("the kvalloc command is the kvalloc_cli package: run `kvalloc` or `python -m kvalloc_cli` "
         "(pip install 'pykvalloc[cli,tui]')")
