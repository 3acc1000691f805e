"""A multi-turn tool rollout on CPU: the model may call a calculator, and is trained only on its own tokens.

    python -m launch.main --custom_generate_fn=examples.calculator_tool:generate \
        --custom_reward_fn=examples.calculator_tool:reward ...

Protocol (character tokens of the addition task): turn 1 either answers ("42<eos>") or calls the
tool by writing an expression ending in "?" ("17+25?"). The environment then appends the tool's
output, the value and a ":" ("42:"), and turn 2 writes the final answer ("42<eos>"). The tool
output is not the model's choice, so its loss_mask is 0; everything the model wrote is 1.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from launch.engines.base import Engine, Request, request_seed
from launch.plugins import GenerateContext, RewardInput, Trajectory
from miles_fn import prng
from miles_fn.sampling import SamplingConfig
from miles_fn.tokenizer import CharTokenizer

CALL, RESULT_END = "?", ":"
EOS = CharTokenizer().eos_id
_EXPR = re.compile(r"^(\d{1,6})([+\-*])(\d{1,6})$")


def calculator(expr: str) -> str:
    """a+b, a-b or a*b of small non-negative integers; "err" for anything else (never eval)."""
    m = _EXPR.match(expr)
    if not m:
        return "err"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def generate(engine: Engine, requests: Sequence[Request], sampling: SamplingConfig, ctx: GenerateContext
             ) -> list[Trajectory]:
    call_id = ctx.encode(CALL)[0]
    first = engine.generate(requests, dataclasses.replace(sampling, stop_token_ids=(*sampling.stop_token_ids,
                                                                                     call_id)))
    out: list[Trajectory | None] = [None] * len(requests)
    follow: list[tuple[int, list[int], Request]] = []
    for i, (r, s) in enumerate(zip(requests, first, strict=True)):
        mask = [1] * len(s.tokens)
        if s.tokens and s.tokens[-1] == call_id:
            tool = ctx.encode(calculator(ctx.decode(s.tokens[:-1])) + RESULT_END)
            turn2 = Request(r.rid, r.input_ids + s.tokens + tool, request_seed(prng.key(r.seed), 1))
            follow.append((i, tool, turn2))
        out[i] = Trajectory(list(s.tokens), list(s.logprobs), mask, s.finish_reason, s.weight_version)
    if follow:
        second = engine.generate([q for _, _, q in follow], sampling)
        for (i, tool, _), s in zip(follow, second, strict=True):
            t1 = out[i]
            assert t1 is not None
            out[i] = Trajectory(t1.tokens + tool + list(s.tokens), t1.logprobs + [0.0] * len(tool) + list(s.logprobs),
                                t1.loss_mask + [0] * len(tool) + [1] * len(s.tokens), s.finish_reason,
                                min(t1.weight_version, s.weight_version))
    return [t for t in out if t is not None]


def reward(sample: RewardInput) -> float:
    """1 when the final answer (after the last tool result, if any) is the sum and the model stopped."""
    a, b = sample.label  # the addition task's label: the pair of operands
    answer = sample.response.rsplit(RESULT_END, 1)[-1]
    return 1.0 if sample.response_ids and sample.response_ids[-1] == EOS and answer == str(a + b) else 0.0
