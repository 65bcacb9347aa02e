"""python -m loom ...: the loom command line installed with the package."""
import os
import sys


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    for exe in (os.path.join(here, "bin", "loom"), os.path.join(root, "build-cuda", "loom"),
                os.path.join(root, "build", "loom")):
        if os.access(exe, os.X_OK):
            os.execv(exe, [exe] + sys.argv[1:])
    sys.stderr.write("loom: the loom command was not found next to the package; reinstall with "
                     "`pip install .`\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
