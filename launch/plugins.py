"""User hooks by import path: `--custom_reward_fn=module:function`, `--custom_generate_fn=module:function`.

Reward function: fn(sample: RewardInput) -> a real number (float, int, numpy.float32, a one-element
tensor), or an async def returning one (all samples of a step are then awaited together). An
exception in it, a value that is not a finite real number (nan, inf, a string, a bool), or a call
longer than `--reward_timeout_s` becomes RewardError naming the sample (index, prompt, response,
label) and the cause; with `--reward_errors=zero` the sample scores 0, the step's `reward_errors`
metric counts it and one line per failure goes to stderr.

Generate function (multi-turn, tools): fn(engine, requests, sampling, ctx: GenerateContext)
-> list[Trajectory], one per request in order. A trajectory's tokens are everything after the
prompt (model turns and tool/environment output), with loss_mask 1 on the model's own tokens and
0 on the rest; its logprobs are the engine's for model tokens (0.0 elsewhere). Example:
examples/calculator_tool.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import math
import numbers
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from launch.engines.base import Engine, Request
from miles_fn.sampling import SamplingConfig


class PluginError(Exception):
    """A plugin could not be loaded or misbehaved: the message names the flag or the sample."""


class RewardError(PluginError):
    pass


@dataclasses.dataclass(frozen=True)
class RewardInput:
    index: int  # position in the step's batch
    prompt_ids: list[int]
    response_ids: list[int]
    prompt: str  # decoded text, for reward functions that work on text
    response: str
    label: Any  # the dataset's label for this prompt (None when there is none)


class Trajectory(NamedTuple):
    tokens: list[int]  # after the prompt: model turns and tool output, in order
    logprobs: list[float]  # one per token (0.0 on tool tokens)
    loss_mask: list[int]  # 1 = a model token the loss trains on, 0 = tool / environment token
    finish_reason: str
    weight_version: int


@dataclasses.dataclass(frozen=True)
class GenerateContext:
    decode: Callable[[list[int]], str]
    encode: Callable[[str], list[int]]
    eos_id: int


def load_function(spec: str, flag: str) -> Callable[..., Any]:
    """The callable named by "package.module:function"; PluginError naming `flag` otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"--{flag}={spec}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"--{flag}={spec}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PluginError(f"--{flag}={spec}: {module_name!r} has no function {attr!r}")
    return fn


def as_reward(value: Any) -> float:
    """A reward as a finite float: any real number (int, float, numpy.float32, a one-element tensor or array);
    TypeError for anything else (bool included: True is an int, but never a meant score), ValueError for nan/inf."""
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()  # a numpy or torch scalar, or a one-element array or tensor
        except (ValueError, RuntimeError):
            pass  # more than one element: refused below
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a float (any finite real number)")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"returned {out}, expected a finite number")
    return out


class _Worker:
    """One daemon thread that runs sync reward calls in order, so that a call can be waited for with a limit.
    A call past the limit is abandoned with its thread (Python cannot stop a thread); the next call gets a new one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="reward-fn", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, arg, box, done = self._jobs.get()
            try:
                box.append((fn(arg), None))
            except Exception as e:  # noqa: BLE001 (reported with its sample)
                box.append((None, e))
            done.set()

    def call(self, fn: Callable[[Any], Any], arg: Any, timeout_s: float) -> tuple[Any, BaseException | None, bool]:
        """(value, error, timed_out)."""
        box: list[tuple[Any, BaseException | None]] = []
        done = threading.Event()
        self._jobs.put((fn, arg, box, done))
        if not done.wait(timeout_s):
            return None, None, True
        return (*box[0], False)


def compute_rewards(fn: Callable[[RewardInput], Any], samples: Sequence[RewardInput], on_error: str = "raise",
                    timeout_s: float = 0.0) -> tuple[list[float], int]:
    """(rewards, number of samples whose reward function failed). Async functions run concurrently.

    A call that raises, returns something that is not a finite real number, or takes longer than
    `timeout_s` (--reward_timeout_s; 0 = no limit) fails its sample: RewardError naming it, or a 0 under
    --reward_errors=zero.
    """

    def settle(s: RewardInput, value: Any, error: BaseException | None) -> float | None:
        if error is None:
            try:
                return as_reward(value)
            except (TypeError, ValueError) as e:
                error = e
        frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
        at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        msg = (f"reward function failed on sample {s.index} (prompt {s.prompt!r}, response {s.response!r}, "
               f"label {s.label!r}): {type(error).__name__}: {error}{at}")
        if on_error != "zero":
            raise RewardError(msg + " (--reward_errors=zero scores such samples 0 and goes on)") from error
        print(f"warning: {msg}; scored 0", file=sys.stderr, flush=True)
        return None

    def timed_out() -> TimeoutError:
        return TimeoutError(f"did not return within --reward_timeout_s={timeout_s:g} seconds")

    if inspect.iscoroutinefunction(fn):
        async def one(s: RewardInput) -> tuple[Any, BaseException | None]:
            try:
                if timeout_s > 0:
                    return await asyncio.wait_for(fn(s), timeout_s), None
                return await fn(s), None
            except asyncio.TimeoutError:
                return None, timed_out()
            except Exception as e:  # noqa: BLE001
                return None, e

        async def all_of() -> list[tuple[Any, BaseException | None]]:
            return list(await asyncio.gather(*(one(s) for s in samples)))

        results = asyncio.run(all_of())
    elif timeout_s > 0:
        results, worker = [], None
        for s in samples:
            worker = worker or _Worker()
            value, error, late = worker.call(fn, s, timeout_s)
            if late:
                error, worker = timed_out(), None  # that thread is still inside fn: leave it
            results.append((value, error))
    else:
        results = []
        for s in samples:
            try:
                results.append((fn(s), None))
            except Exception as e:  # noqa: BLE001 (reported with its sample)
                results.append((None, e))
    settled = [settle(s, v, e) for s, (v, e) in zip(samples, results, strict=True)]
    return [0.0 if v is None else v for v in settled], sum(v is None for v in settled)


def run_custom_generate(fn: Callable[..., Any], engine: Engine, requests: Sequence[Request],
                        sampling: SamplingConfig, ctx: GenerateContext) -> list[Trajectory]:
    """Call a custom generate function and check what it returns (lengths, mask values, order)."""
    out = fn(engine, list(requests), sampling, ctx)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    out = list(out)
    if len(out) != len(requests):
        raise PluginError(f"--custom_generate_fn returned {len(out)} trajectories for {len(requests)} requests")
    for i, t in enumerate(out):
        if not (len(t.tokens) == len(t.logprobs) == len(t.loss_mask)):
            raise PluginError(f"--custom_generate_fn: trajectory {i} has {len(t.tokens)} tokens, "
                              f"{len(t.logprobs)} logprobs and {len(t.loss_mask)} loss_mask entries")
        if any(m not in (0, 1) for m in t.loss_mask):
            raise PluginError(f"--custom_generate_fn: trajectory {i} has a loss_mask entry other than 0/1")
    return out


async def _await(x: Any) -> Any:
    return await x
