"""Builds libloom and the loom command with the project's Makefile and puts
them inside the package (loom/lib/libloom.so, loom/bin/loom).

    pip install .                  CPU build; CUDA too when nvcc is found
    LOOM_CUDA=1 pip install .      CUDA required (fails without nvcc)
    LOOM_CUDA=0 pip install .      CPU only
    LOOM_MAKE_ARGS='BLAS=blas' ... extra make arguments
"""
import os
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda():
    v = os.environ.get("LOOM_CUDA", "auto")
    if v in ("0", "no", "off"):
        return False
    found = shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")
    if v in ("1", "yes", "on"):
        if not found:
            raise SystemExit("LOOM_CUDA=1: nvcc not found on PATH or in /usr/local/cuda/bin; "
                             "install the CUDA toolkit or set CUDA_HOME's bin on PATH")
        return True
    return bool(found)


class BuildWithMake(build_py):
    def run(self):
        cuda = _want_cuda()
        build = os.path.join("build", "pip-cuda" if cuda else "pip")
        args = ["make", "-C", ROOT, "-j%d" % max(1, os.cpu_count() or 1), "BUILD=" + build,
                build + "/libloom.so", build + "/loom"]
        if cuda:
            args.insert(4, "CUDA=1")
        args += shlex.split(os.environ.get("LOOM_MAKE_ARGS", ""))
        print("loom: " + " ".join(args))
        try:
            subprocess.check_call(args)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit("loom: building the library failed (%s); install the build packages "
                             "the README lists (build-essential, libopenblas-dev; optional: "
                             "openmpi-bin libopenmpi-dev, libgloo-dev, the CUDA toolkit)" % e)
        super().run()
        pkg = os.path.join(self.build_lib, "loom")
        for src, sub in ((os.path.join(ROOT, build, "libloom.so"), "lib"),
                         (os.path.join(ROOT, build, "loom"), "bin")):
            os.makedirs(os.path.join(pkg, sub), exist_ok=True)
            dst = os.path.join(pkg, sub, os.path.basename(src))
            shutil.copy2(src, dst)


class BinaryDistribution(Distribution):
    """The wheel carries a native library: platform-specific, not pure."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithMake}, distclass=BinaryDistribution)
