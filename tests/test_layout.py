"""The product's parts are imported as edgemoe.*, never as bare top-level packages."""

import re
import subprocess
import sys
from pathlib import Path

import edgemoe.kernels
import edgemoe.quant
import edgemoe.store

REPO = Path(__file__).resolve().parents[1]


def test_subpackages_live_in_their_top_level_folders():
    assert Path(edgemoe.store.__file__).parent == REPO / "store"
    assert Path(edgemoe.quant.__file__).parent == REPO / "quant"
    assert Path(edgemoe.kernels.__file__).parent == REPO / "kernels"


def test_no_bare_import_of_store_quant_or_kernels_in_the_code():
    bare = re.compile(r"^\s*(import|from)\s+(store|quant|kernels)\b", re.MULTILINE)
    offenders = [str(p.relative_to(REPO)) for folder in ("edgemoe", "store", "quant", "kernels", "tools", "tests")
                 for p in (REPO / folder).rglob("*.py") if bare.search(p.read_text())]
    assert offenders == []


def test_installing_edgemoe_exposes_no_bare_package(tmp_path):
    probe = "import importlib.util as u; print([n for n in ('store', 'quant', 'kernels') if u.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
