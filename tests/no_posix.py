"""The no-POSIX mode (env H3_WITHOUT_POSIX=1): the test process looks like Windows' Python to h3_core.

`apply()` removes `os.preadv`, `os.pread`, `os.posix_fadvise`, `os.sysconf` and the `os.POSIX_FADV_*` constants,
and makes `import resource` raise ImportError in h3_core and the nodes. It must run before h3_core is imported
(modules pick their OS calls once at import). It proves no POSIX-only call is reached; it does not prove Windows
paths, locking or signal delivery."""

import builtins
import os
import sys

REMOVED = ("preadv", "pread", "posix_fadvise", "sysconf")
ENV = "H3_WITHOUT_POSIX"


OURS = ("h3_core", "nodes", "__main__")


def _refusing_import(original):
    """`import resource` from our code raises ImportError, as on Windows; the reference libraries the tests use as
    oracles (transformers -> psutil, on Linux) still import it, and a module they loaded is still refused to us."""

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "resource" and level == 0 and str((globals or {}).get("__name__", "")).startswith(OURS):
            raise ImportError("No module named 'resource' (H3_WITHOUT_POSIX)", name=name)
        return original(name, globals, locals, fromlist, level)

    _import.h3_without_posix = True
    return _import


def apply() -> None:
    try:  # psutil (the reference libraries' import, through transformers) reads os.sysconf at import on Linux
        import psutil  # noqa: F401
    except ImportError:
        pass
    for name in REMOVED + tuple(n for n in dir(os) if n.startswith("POSIX_FADV_")):
        if hasattr(os, name):
            delattr(os, name)
    if not getattr(builtins.__import__, "h3_without_posix", False):
        builtins.__import__ = _refusing_import(builtins.__import__)


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


if __name__ == "__main__":  # python tests/no_posix.py -m MODULE ARGS...: run a module in the mode
    import runpy

    apply()
    assert sys.argv[1] == "-m", "usage: no_posix.py -m MODULE [ARGS]"
    module = sys.argv[2]
    sys.argv = [module] + sys.argv[3:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
