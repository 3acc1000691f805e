"""examples/openai_agent.py: a multi-turn tool agent on the `openai` client, through a rollout server and through a
fleet behind sglang-router, trains on the bits of examples/calculator_tool.py on the embedded engine (the
independent reference: no HTTP, no OpenAI schema) at the same --rollout_batch_size=1."""

import pytest

from tests.test_rollout_main import run_main, summary

pytest.importorskip("openai")

TOOL = ["--rollout_batch_size=1", "--custom_reward_fn=examples.calculator_tool:reward", "--eval_every=1",
        "--temperature=1.0"]


def test_the_openai_agent_trains_on_the_bits_of_the_in_process_tool_rollout(tmp_path):
    ref = run_main(tmp_path / "ref", *TOOL, "--custom_generate_fn=examples.calculator_tool:generate")
    want = summary(ref)
    rows = (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    agent = ["--custom_generate_fn=examples.openai_agent:generate", "--rollout_backend=http"]
    for name, extra in (("one", []), ("fleet", ["--rollout_num_engines=2"])):
        p = run_main(tmp_path / name, *TOOL, *agent, *extra)
        assert summary(p)["state_hash"] == want["state_hash"], p.stderr[-2000:]
        assert (tmp_path / name / "metrics.jsonl").read_bytes() == rows
    assert len(rows.decode().splitlines()) == 2


def test_the_agent_calls_the_tool_and_masks_its_output_as_the_in_process_rollout_does(tmp_path):
    """Both turns and the tool tokens, against calculator_tool on the embedded engine (batch 1) in this process."""
    from examples import calculator_tool, openai_agent
    from launch.engines.base import make_requests
    from launch.engines.embedded import EmbeddedEngine
    from launch.plugins import GenerateContext
    from launch.rollout_server import server_ops
    from miles_fn import model, prng
    from miles_fn.sampling import SamplingConfig
    from tests.openai_fixtures import CFG, CHARS, save_checkpoint, server

    proc = server(save_checkpoint(str(tmp_path / "ckpt"), seed=3), str(tmp_path / "s.log"))
    try:
        url = proc.start()
        engine = type("E", (), {"client": type("C", (), {"url": url})(), "version": 0})()
        ctx = GenerateContext(CHARS.decode, CHARS.encode, CHARS.eos_id)
        prompts = [[CHARS.bos_id, *CHARS.encode(f"{a}+{b}=")] for a, b in [(1, 2), (30, 4), (5, 66), (7, 7)] * 6]
        reqs = make_requests(prompts, prng.key(11))
        sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=12, stop_token_ids=(CHARS.eos_id,))
        got = openai_agent.generate(engine, reqs, sampling, ctx)
    finally:
        proc.stop()
    ref = EmbeddedEngine(CFG, model.init_params(CFG, prng.key(3), 0.3), 0, 1, server_ops(False, 0, 0))
    want = calculator_tool.generate(ref, reqs, sampling, ctx)
    assert got == want
    assert any(0 in t.loss_mask for t in got), "no trajectory called the tool: pick other prompts or seeds"


def test_the_agent_names_the_backend_it_needs(tmp_path):
    p = run_main(tmp_path, *TOOL, "--custom_generate_fn=examples.openai_agent:generate")
    assert p.returncode != 0 and "--rollout_backend=http" in p.stderr and "Traceback" not in p.stderr
