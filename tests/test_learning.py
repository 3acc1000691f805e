"""The default job learns: a shortened run of the shipped flagfile raises held-out success.

The full job (700 steps) reaches 0.99 from 0.15; 250 steps must at least reach 0.4
(measured 0.66), which no run whose gradients point the wrong way or whose rewards,
advantages or masks are misaligned can do.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_grpo_raises_heldout_success(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "launch.main", "--flagfile=launch/flags/cpu_tiny.flags", "--num_steps=250",
         "--eval_every=0", "--save_every=0", "--notensorboard", "--noprogress", f"--output_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    vals = dict(re.findall(r"(\w+)=([0-9.]+)", p.stdout))
    step0, final = float(vals["eval_success_step0"]), float(vals["eval_success_final"])
    assert step0 < 0.25
    assert final >= 0.4 and final >= 2 * step0, (step0, final)
