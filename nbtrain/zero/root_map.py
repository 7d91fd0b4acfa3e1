"""Which `ModelRoot` (root.py) each model has: a weak map, so a root dies with its model.

Below block.py and root.py, which both read it: `ModelRoot.of` makes and finds roots,
and a Block drops the roots of the modules it takes over.
"""

import weakref

ROOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
