"""--helpshort lists a first run's flags by topic, and launch/flags.py defines the flags under the same topics."""

import pathlib
import re
import subprocess
import sys

from launch import flags as run_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = (ROOT / "launch" / "flags.py").read_text()


def sections() -> list[tuple[str, list[str]]]:
    """(topic, flags defined under it) for each "# == Topic: ..." section of launch/flags.py, in order."""
    out: list[tuple[str, list[str]]] = []
    for line in SOURCE.splitlines():
        head = re.match(r"# == ([^:]+):", line)
        if head:
            out.append((head.group(1), []))
        name = re.match(r'flags\.DEFINE_\w+\(\s*"(\w+)"', line)
        if name:
            assert out, f"--{name.group(1)} is defined before the first section"
            out[-1][1].append(name.group(1))
    return out


def test_short_help_topics_are_the_sections_of_flags_py_in_order():
    topics = [t for t, names in sections() if names]
    assert [t for t, _ in run_flags.SHORT_HELP] == topics


def test_each_short_help_flag_is_defined_under_its_topic():
    where = {n: t for t, names in sections() for n in names}
    for topic, names in run_flags.SHORT_HELP:
        for n in names:
            assert where.get(n) == topic, f"--{n} is listed under {topic!r} but defined under {where.get(n)!r}"


def test_helpshort_prints_the_topics_and_exits_zero():
    p = subprocess.run([sys.executable, "-m", "launch.main", "--helpshort"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    positions = [p.stdout.index(f"\n{t}:\n") for t, _ in run_flags.SHORT_HELP]
    assert positions == sorted(positions)
    for _, names in run_flags.SHORT_HELP:
        for n in names:
            assert f"  --{n}: " in p.stdout
    assert "--debug_block_at" not in p.stdout  # a test hook, not a first run's flag
