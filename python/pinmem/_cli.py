"""The `pinmem` console script: runs the command-line tool the wheel ships in pinmem/_bin.

The tool is the same C program `cmake --build` makes (`pinmem info`, `pinmem bench ...`); the
script only finds it inside the installed package and replaces itself with it (exec), so its
exit status, signals and output are the tool's own.
"""
import os
import sys


def _package_dirs():
    # Every folder of the package, in import order, not only this file's: an editable install
    # (`pip install -e .`) runs this file from the source tree while the built tool, like the
    # extension module, is installed in site-packages' pinmem folder (both are on __path__).
    here = os.path.dirname(os.path.abspath(__file__))
    package = sys.modules.get(__name__.rpartition(".")[0]) if "." in __name__ else None
    dirs = [os.path.abspath(d) for d in getattr(package, "__path__", [])]
    return dirs + [here] if here not in dirs else dirs


def main():
    tried = [os.path.join(d, "_bin", "pinmem") for d in _package_dirs()]
    exe = next((t for t in tried if os.access(t, os.X_OK)), None)
    if exe is None:
        sys.exit(f"pinmem: the command-line tool is not in this installation ({', '.join(tried)} "
                 "missing); it comes with the wheel and `pip install .` (`pip install -e .` too), "
                 "or build it with cmake (docs/install.md)")
    os.execv(exe, [exe] + sys.argv[1:])


if __name__ == "__main__":
    main()
