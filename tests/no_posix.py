"""The no-POSIX mode (env H3_WITHOUT_POSIX=1): the test process looks like Windows' Python to h3_core.

`apply()` removes `os.preadv`, `os.pread`, `os.posix_fadvise` and the `os.POSIX_FADV_*` constants, and makes
`import resource` raise ImportError. It must run before h3_core is imported (modules pick their OS calls once at
import). It proves no POSIX-only call is reached; it does not prove Windows paths, locking or signal delivery."""

import os
import sys

REMOVED = ("preadv", "pread", "posix_fadvise")
ENV = "H3_WITHOUT_POSIX"


class _NoResource:
    """A meta-path finder that refuses `resource`, as on Windows."""

    def find_spec(self, name, path=None, target=None):
        if name == "resource":
            raise ImportError("No module named 'resource' (H3_WITHOUT_POSIX)", name=name)
        return None


def apply() -> None:
    for name in REMOVED + tuple(n for n in dir(os) if n.startswith("POSIX_FADV_")):
        if hasattr(os, name):
            delattr(os, name)
    sys.modules.pop("resource", None)
    if not any(isinstance(f, _NoResource) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoResource())


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


if __name__ == "__main__":  # python tests/no_posix.py -m MODULE ARGS...: run a module in the mode
    import runpy

    apply()
    assert sys.argv[1] == "-m", "usage: no_posix.py -m MODULE [ARGS]"
    module = sys.argv[2]
    sys.argv = [module] + sys.argv[3:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
