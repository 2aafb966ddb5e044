"""The `pinmem` console script: runs the command-line tool the wheel ships in pinmem/_bin.

The tool is the same C program `cmake --build` makes (`pinmem info`, `pinmem bench ...`); the
script only finds it inside the installed package and replaces itself with it (exec), so its
exit status, signals and output are the tool's own.
"""
import os
import sys


def main():
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "pinmem")
    if not os.access(exe, os.X_OK):
        sys.exit(f"pinmem: the command-line tool is not in this installation ({exe} is missing); "
                 "it comes with the wheel and `pip install .`, or build it with cmake "
                 "(docs/install.md)")
    os.execv(exe, [exe] + sys.argv[1:])


if __name__ == "__main__":
    main()
