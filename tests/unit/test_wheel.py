"""The wheel is complete: built from the repository with `pip wheel --no-deps` and installed in a
fresh virtual environment, it trains from its own presets (paratron/configs ships as package data).

The fresh environment gets the dependencies (torch, ...) through a .pth line naming this
interpreter's site-packages; that directory's own .pth files (the editable install of the
repository among them) are not run for such a line, so the paratron imported is the wheel's."""
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".whl", ".peers")


def run(cmd, cwd, **kw):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_wheel_in_a_fresh_venv_trains_the_tiny_preset(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, symlinks=True, ignore=COPY_IGNORE)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
         src], cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("paratron-*.whl"))
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
        cwd=tmp_path)
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp_path).stdout.strip())
    (site / "shared_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean = {"PATH": f"{env / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH to the repository
    where = run([python, "-c", "import paratron.config as c; print(c.__file__); print(c.PRESET_DIR)"],
                cwd=tmp_path, env=clean).stdout.split()
    assert all(Path(p).is_relative_to(site / "paratron") for p in where), where
    assert (Path(where[1]) / "tiny.yaml").is_file()
    out = run([env / "bin" / "paratron", "train", "--config", "tiny", "--train-iters", "2", "--eval-iters", "0",
               "--log-interval", "1"], cwd=tmp_path, env=clean).stdout
    assert "iteration        2/       2" in out, out
