"""`dflash` names another installed distribution that provides the `dflash` command or
the `dflash_mlx` package (importlib.metadata), e.g. a PyPI package of the same name."""

import importlib.metadata as md
import subprocess
import sys

from dflash_mlx.cli.main import conflicts, warning


def fake_dist(root, name, version, entry_point=None, top_level=None, record=None):
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_point:
        (info / "entry_points.txt").write_text(f"[console_scripts]\ndflash = {entry_point}\n")
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level + "\n")
    if record is not None:
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in record))
    return info


def test_conflicts_are_named(tmp_path):
    fake_dist(tmp_path, "dflash", "0.3.1", entry_point="dflash.cli:main", top_level="dflash")
    fake_dist(tmp_path, "dflash-mlx", "0.9.0", entry_point="dflash_mlx.cli:run", top_level="dflash_mlx")
    fake_dist(tmp_path, "other-mlx", "1.0", record=["dflash_mlx/__init__.py", "other/x.py"])
    fake_dist(tmp_path, "dflash-mlx", "0.1.0", entry_point="dflash_mlx.cli.main:main", top_level="dflash_mlx")
    fake_dist(tmp_path, "numpy", "2.0", top_level="numpy")
    found = conflicts(md.distributions(path=[str(tmp_path)]))
    assert len(found) == 3, found
    assert any(f.startswith("dflash 0.3.1 (a 'dflash' command (dflash.cli:main);") for f in found)
    assert any(f.startswith("dflash-mlx 0.9.0 (a 'dflash' command (dflash_mlx.cli:run) and a 'dflash_mlx' package;")
               for f in found)
    assert any(f.startswith("other-mlx 1.0 (a 'dflash_mlx' package;") for f in found)
    line = warning(found)
    assert "\n" not in line and "pip uninstall dflash dflash-mlx other-mlx" in line and "pipx install" in line


def test_this_environment_has_none():
    assert conflicts() == [] and warning([]) is None


def test_cli_warns_once(tmp_path):
    fake_dist(tmp_path, "dflash", "0.3.1", entry_point="dflash.cli:main")
    r = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
                        "from dflash_mlx.cli.main import main; main(['--help'])"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("warning: also installed here: dflash 0.3.1")]
    assert len(lines) == 1, r.stderr
