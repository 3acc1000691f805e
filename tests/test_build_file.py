"""BUILD stays true to the tree: every named source exists and every test file has a target."""

import glob
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = (ROOT / "BUILD").read_text()


def test_every_listed_source_exists():
    for path in re.findall(r'"([\w/]+\.py)"', TEXT):
        assert (ROOT / path).is_file(), f"BUILD names {path}, which does not exist"
    for pattern in re.findall(r'glob\(\["([^"]+)"\]\)', TEXT):
        assert glob.glob(str(ROOT / pattern), recursive=True), f"BUILD glob {pattern} matches nothing"


def test_every_test_file_has_a_target():
    named = set(re.findall(r'py_test\(name = "(\w+)"', TEXT))
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        assert f.stem in named, f"tests/{f.name} has no py_test target in BUILD"


def test_every_package_has_a_library():
    for pkg in ("miles_fn", "ops", "state", "launch", "third_party"):
        assert f'"{pkg}/' in TEXT, f"package {pkg} is in no BUILD target"
