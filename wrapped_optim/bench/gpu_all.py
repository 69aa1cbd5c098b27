"""``python -m wrapped_optim.bench.gpu_all``: run the GPU checks of a source checkout.

The checks are test code and live in the repository's ``tests/gpu`` (they import the test
tree), so they do not ship in the wheel. This entry point finds the checkout this package was
installed from (an editable install) or the current directory, and hands over to
``tests.gpu.gpu_all``. Without a checkout it says so and exits 2, the GPU run's exit code for
"not run", never 0.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

NOT_RUN = 2


def checkout_roots() -> list[Path]:
    """Where a checkout with ``tests/gpu`` may be: above this package, then the working dir.

    Example:
        >>> roots = checkout_roots()
        >>> roots[-1] == Path.cwd().resolve()
        True
    """
    return [Path(__file__).resolve().parents[2], Path.cwd().resolve()]


def find_checkout(roots: Sequence[Path] | None = None) -> Path | None:
    """The first of ``roots`` holding ``tests/gpu/gpu_all.py``, or None.

    Example:
        >>> import tempfile
        >>> find_checkout([Path(tempfile.mkdtemp())]) is None
        True
    """
    for root in checkout_roots() if roots is None else roots:
        if (root / "tests" / "gpu" / "gpu_all.py").is_file():
            return root
    return None


def _load_main(root: Path) -> Callable[[Sequence[str] | None], int]:
    """Import ``tests.gpu.gpu_all`` from the checkout at ``root`` and return its ``main``."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module("tests.gpu.gpu_all")
    main: Callable[[Sequence[str] | None], int] = module.main
    return main


def main(argv: Sequence[str] | None = None, roots: Sequence[Path] | None = None) -> int:
    """Run the GPU checks (arguments as ``python -m tests.gpu.gpu_all``); 2 without a checkout.

    Example:
        >>> import tempfile
        >>> main([], roots=[Path(tempfile.mkdtemp())])  # no checkout there
        2
    """
    root = find_checkout(roots)
    if root is None:
        print(
            "wrapped_optim.bench.gpu_all: no source checkout with tests/gpu found (looked in "
            + ", ".join(str(r) for r in (checkout_roots() if roots is None else roots))
            + "); run it from a clone of the repository. Nothing was checked.",
            file=sys.stderr,
        )
        return NOT_RUN
    return _load_main(root)(argv)


if __name__ == "__main__":
    sys.exit(main())
