"""An agent written against the `openai` client, driving multi-turn tool rollouts while the trainer trains on exact ids.

    python -m launch.main --rollout_backend=http --rollout_batch_size=1 [--rollout_num_engines=3] \
        --custom_generate_fn=examples.openai_agent:generate --custom_reward_fn=examples.calculator_tool:reward ...

The protocol is examples/calculator_tool.py's (turn 1 answers or writes "17+25?", the tool appends "42:",
turn 2 answers), but every model turn is one `client.completions.create` call to the run's rollout server
(or its router) at /v1: the prompt goes as ids (the `input_ids` extension, which sglang-router forwards;
it refuses an id `prompt`) and the seed as a signed 64-bit integer (it refuses
larger ones; the server reads the same key), and the reply's `token_ids`, `logprobs.token_logprobs` and
`meta_info.weight_version` become the trajectory. Nothing is re-tokenized, so the trainer sees the ids
the engine sampled (token in, token out), with the request's own seed, so the run gives the bits of
calculator_tool on the embedded engine at --rollout_batch_size=1 (tests/test_openai_agent.py).

An agent framework does the same: point its OpenAI client at the server's /v1, send ids (or text, with a
server started with --tokenizer-path), keep `prompt_token_ids` + `token_ids` and the log-probs of each turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from examples.calculator_tool import CALL, RESULT_END, calculator
from launch.engines.base import Engine, EngineError, Request, Sample, request_seed
from launch.engines.openai_api import signed_seed
from launch.engines.remote import check_samples
from launch.plugins import GenerateContext, Trajectory
from miles_fn import prng
from miles_fn.sampling import SamplingConfig


def base_url(engine: Engine) -> str:
    """The OpenAI base URL of the run's engine: its server's, or its router's for a fleet."""
    url = getattr(getattr(engine, "client", None), "url", "")
    if not url:
        raise EngineError(f"examples.openai_agent talks HTTP, and the {type(engine).__name__} has no server: run "
                          "with --rollout_backend=http (one server, --rollout_num_engines=N, or --rollout_router_url)")
    return url + "/v1"


def turn(client: Any, ids: list[int], seed: int, sampling: SamplingConfig, stop: Sequence[int]) -> Sample:
    """One model turn through the OpenAI API: the sampled ids, their log-probs and weight version, as the engine's."""
    r = client.completions.create(
        model="miles-fn", prompt="", max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, seed=signed_seed(seed), logprobs=0,
        extra_body={"input_ids": ids, "stop_token_ids": list(stop), "top_k": sampling.top_k or -1,
                    "ignore_eos": True, "return_token_ids": True})
    (c,) = r.choices
    if c.prompt_token_ids != ids:
        raise EngineError(f"{client.base_url}: the reply's prompt_token_ids are not the ids sent")
    return Sample(list(c.token_ids), list(c.logprobs.token_logprobs), c.finish_reason,
                  int(c.meta_info["weight_version"]))


def generate(engine: Engine, requests: Sequence[Request], sampling: SamplingConfig, ctx: GenerateContext
             ) -> list[Trajectory]:
    import openai

    call_id = ctx.encode(CALL)[0]
    client = openai.OpenAI(base_url=base_url(engine), api_key="unused", max_retries=2, timeout=120)

    def one(r: Request) -> Trajectory:
        first = turn(client, r.input_ids, r.seed, sampling, (*sampling.stop_token_ids, call_id))
        check_samples([first], engine.version, sampling.vocab_limit, client.base_url)
        if not (first.tokens and first.tokens[-1] == call_id):
            return Trajectory(first.tokens, first.logprobs, [1] * len(first.tokens), first.finish_reason,
                              first.weight_version)
        tool = ctx.encode(calculator(ctx.decode(first.tokens[:-1])) + RESULT_END)
        second = turn(client, r.input_ids + first.tokens + tool, request_seed(prng.key(r.seed), 1), sampling,
                      sampling.stop_token_ids)
        check_samples([second], engine.version, sampling.vocab_limit, client.base_url)
        return Trajectory(first.tokens + tool + second.tokens, first.logprobs + [0.0] * len(tool) + second.logprobs,
                          [1] * len(first.tokens) + [0] * len(tool) + [1] * len(second.tokens), second.finish_reason,
                          min(first.weight_version, second.weight_version))

    try:
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="openai-agent") as pool:
            return list(pool.map(one, requests))
    except openai.APIError as e:
        raise EngineError(f"examples.openai_agent: {type(e).__name__}: {e}") from None
    finally:
        client.close()
