"""The gpupool package's tests run on the simulated device: two devices of 1 GiB, set before
the library starts (it reads GPUPOOL_* at its first call, once per process). They test the
package as installed (`pip install .`): with GPUPOOL_TEST_INSTALLED=1 (CI sets it), a test
fails when `import gpupool` finds the repository's python/ folder or a library other than the
one inside the package.

    pip install .[test] && GPUPOOL_TEST_INSTALLED=1 python -m pytest tests/python/package
"""

import os

os.environ.setdefault("GPUPOOL_DRIVER", "sim")
os.environ.setdefault("GPUPOOL_SIM_DEVICES", "2")
os.environ.setdefault("GPUPOOL_SIM_CAPACITY", "1GiB")
