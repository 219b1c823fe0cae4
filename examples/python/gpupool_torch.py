"""gpupool under PyTorch: this module is now the gpupool package's `gpupool.torch`, kept here
so that `import gpupool_torch` from examples/python (or <prefix>/share/gpupool/python) goes on
working. New code: `pip install .` at the repository's root, then

    import torch, gpupool
    gpupool.torch.install()          # before the first CUDA tensor
    print(gpupool.torch.summary())

Without the package installed, the copy beside this file (the repository's python/, or the
installed prefix's share/gpupool/python/) is used.
"""

import pathlib
import sys

try:
    import gpupool.torch as _impl
except ImportError:
    here = pathlib.Path(__file__).resolve().parent
    # The repository (examples/python/ -> python/), or an installed prefix (the package is
    # installed beside this file).
    for where in (here.parents[1] / "python", here):
        if (where / "gpupool" / "__init__.py").exists():
            sys.path.insert(0, str(where))
            break
    import gpupool.torch as _impl

from gpupool.torch import *  # noqa: E402,F401,F403
from gpupool.torch import _Stats, attach, find_library, graph, install, pool_stats  # noqa: E402,F401

# Module state that install() and graph() change: read from the package when asked (below),
# never a copy taken at import.
del released_by_failed_capture  # noqa: F821


def __getattr__(name):
    # released_by_failed_capture and _graphs, read live from the package.
    return getattr(_impl, name)
