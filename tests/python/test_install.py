"""`pip install .` in a fresh virtual environment: the library builds, the
package imports from the environment (not this checkout) and trains."""
import os
import subprocess
import sys

from conftest import ROOT, run


def test_pip_install_in_a_fresh_venv(tmp_path, tiny_model):
    venv = str(tmp_path / "venv")
    run([sys.executable, "-m", "venv", venv])
    py = os.path.join(venv, "bin", "python")
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOOM_LIBRARY")}
    e["LOOM_CUDA"] = "0"  # the CPU build; CI compiles the CUDA sources on their own
    run([py, "-m", "pip", "install", "-q", ROOT], timeout=1200, env=e)
    script = ("import loom, loom._lib as L, numpy as np\n"
              "assert L.library_path().startswith(%r), L.library_path()\n"
              "m = loom.MegatronModel(%r, mixed_precision='no')\n"
              "m.set_optimizer('default', lr=1e-3)\n"
              "r = m.forward_backward(inputs=[{'input_ids': list(range(16))}])\n"
              "s = m.clip_grad_and_step()\n"
              "print(round(r['loss'], 3), s['stepped'])\n" % (venv, tiny_model))
    p = run([py, "-c", script], env=e, cwd=str(tmp_path))
    assert p.stdout.strip().endswith("True")
    p = run([py, "-m", "loom", "version"], env=e, cwd=str(tmp_path))
    assert p.stdout.startswith("loom ")
    p = run([os.path.join(venv, "bin", "loom"), "version"], env=e, cwd=str(tmp_path))
    assert p.stdout.startswith("loom ")
