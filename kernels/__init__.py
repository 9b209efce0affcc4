"""asyncspec's Triton kernels, installed as `asyncspec.kernels`.

The folder sits at the repository's top level, so wherever a checkout's root is on sys.path (pytest puts it
there for the `tests` package; `python -m` from the root adds the working directory) it is also found as a
top-level `kernels`. That name belongs to a PyPI package, which transformers imports when it is installed (a
dependency of transformers 5.25 and later). Imported under that name, this module hands the import over to
that package, or to an empty module that probes read as not installed, so the checkout never stands in for it.
"""

from __future__ import annotations

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import sys
    import types
    from pathlib import Path

    _checkout = Path(__file__).resolve().parent.parent
    _elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        # Not installed. An exception here would escape the probes of libraries that import a package to read its
        # version (transformers does, for a package without metadata); an empty module without a file and without
        # a version is what they take for a namespace package shadowing nothing: not installed.
        _empty = types.ModuleType("kernels", "Not installed: asyncspec's kernels/ folder is asyncspec.kernels.")
        _empty.__path__ = []
        _empty.__spec__ = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        sys.modules["kernels"] = _empty
    else:
        _installed = importlib.util.module_from_spec(_spec)
        # The import statement returns what sys.modules holds after this body runs: the installed package.
        sys.modules["kernels"] = _installed
        _spec.loader.exec_module(_installed)
