"""Imports torch without the warning it gives when NumPy is not installed.

torch imports fine without NumPy (nothing in wrapped_optim needs it), but warns "Failed to
initialize NumPy" while importing, which every ``wrapped-optim`` command would print. Only
that warning, only during that import, is ignored: the filters are restored afterwards, and
an import of torch made before this package's is untouched.
"""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401
