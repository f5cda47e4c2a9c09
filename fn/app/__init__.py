"""The demo application on top of the library: ``python -m fn demo`` (or ``fn-optim demo``), and
what the repository's example scripts share.

- :mod:`fn.app.cli`: the command line;
- :mod:`fn.app.demo`: the job (a character-level model trained with every compressed optimizer
  on gloo worker processes or simulated ranks);
- :mod:`fn.app.examples`: the example scripts' arguments, models, data and training loop, so
  that each script runs alone, downloaded into an empty folder (docs/examples.md);
- :mod:`fn.app.launch`: the process launcher (gloo workers on this machine) of the demo and of
  the repository's benchmark scripts;
- ``fn.app._data``, ``fn.app._report``, ``fn.app._progress``: the demo's data, its outputs
  (table, CSV, JSON, plot) and its progress display (tqdm, the ``app`` extra).

The library (``fn`` and its other subpackages) never imports this package.
"""
