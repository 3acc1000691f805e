"""Regenerate examples/addition_sft.jsonl: python -m examples.make_addition_sft [N].

The rows follow the default job's task format (launch/flags/cpu_tiny.flags: two digits, fixed width).
"""

import os
import sys

from launch.sft import write_addition_jsonl
from miles_fn.tasks.addition import AdditionTask

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "addition_sft.jsonl")
    write_addition_jsonl(path, n, AdditionTask(digits=2, fixed_width=True))
