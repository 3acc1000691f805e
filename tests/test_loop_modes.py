"""Loop modes (launch/modes.py): rollout-only and train-only debugging, chat templates from --prompt_data,
partial rollouts and one-step-off-policy async rollout, each checked against an independent reference run."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from launch import modes
from launch.engines.config import RolloutConfig
from launch.flags import ReproConfig
from launch.rl import RolloutShaping
from miles_fn import model
from miles_fn.memory import MemoryConfig
from state import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num_steps=3", "--eval_every=0", "--eval_size=4", "--prompts_per_step=4", "--group_size=2",
        "--hidden_size=32", "--intermediate_size=48", "--noprogress", "--notensorboard", "--num_threads=1"]
# No warm-up (rollout-only refuses one); a reward that differs within groups, so every step updates the weights.
RL = [*BASE, "--sft_warmup_steps=0", "--custom_reward_fn=tests.loop_mode_plugins:first_token_parity"]
ROLLOUT_STATS = ("reward_mean", "response_len", "truncated_frac", "informative_groups_frac", "reward_errors")


def run_main(out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.main", *args, f"--output_dir={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def ok(p: subprocess.CompletedProcess) -> dict[str, str]:
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(kv.split("=", 1) for kv in p.stdout.strip().splitlines()[-1].split())


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def saved(root, step):
    return checkpoint.load(os.path.join(root, f"step_{step:08d}")).tree


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The plain synchronous run every mode is compared with (its rollouts saved)."""
    out = tmp_path_factory.mktemp("sync")
    return ok(run_main(out, *RL, f"--save_rollouts={out / 'rollouts'}")), metrics(out), out


# --- flag validation -------------------------------------------------------------------------------------------

def _cfg(**kw):
    m = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in modes.LoopModes.__dataclass_fields__.values()}}
    r = {k: kw.pop(k) for k in list(kw) if k in RolloutConfig.__dataclass_fields__}
    base = dict(modes=modes.LoopModes(**m), rollout=RolloutConfig(**r), sft=False, sft_warmup_steps=0,
                repro=ReproConfig(resume=kw.pop("resume", False)), memory=MemoryConfig(**kw.pop("memory", {})),
                shaping=RolloutShaping(**kw.pop("shaping", {})), tokenizer=kw.pop("tokenizer", ""))
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("kw, needles", [
    (dict(debug_rollout_only=True, debug_train_only=True, load_rollouts="d"),
     ["--debug_rollout_only and --debug_train_only exclude each other"]),
    (dict(debug_train_only=True), ["--debug_train_only", "--load_rollouts=DIR", "--save_rollouts"]),
    (dict(debug_rollout_only=True, load_rollouts="d"), ["--debug_rollout_only", "--load_rollouts=d"]),
    (dict(debug_rollout_only=True, sft_warmup_steps=5), ["--sft_warmup_steps=5", "--sft_warmup_steps=0"]),
    (dict(debug_rollout_only=True, resume=True), ["--debug_rollout_only", "--resume"]),
    (dict(debug_train_only=True, load_rollouts="d", sft=True), ["--debug_train_only", "--sft"]),
    (dict(async_rollout=True, debug_rollout_only=True), ["--async_rollout", "--debug_rollout_only"]),
    (dict(async_rollout=True, memory=dict(offload_train_state=True)), ["--offload_train_state"]),
    (dict(partial_rollouts=True), ["--partial_rollouts", "--over_sampling > 1"]),
    (dict(partial_rollouts=True, over_sampling=2.0, custom_generate_fn="m:f"), ["--custom_generate_fn=m:f"]),
    (dict(partial_rollouts=True, over_sampling=2.0, shaping=dict(dynamic_sampling=True)), ["--dynamic_sampling"]),
    (dict(tokenizer="tok"), ["--tokenizer=tok", "--prompt_data"]),
])
def test_bad_mode_combinations_are_refused_naming_the_flags(kw, needles):
    with pytest.raises(ValueError) as e:
        modes.check(_cfg(**kw))
    for n in needles:
        assert n in str(e.value)


def test_good_mode_combinations_pass():
    for kw in [dict(), dict(debug_rollout_only=True, save_rollouts="d"), dict(debug_train_only=True, load_rollouts="d"),
               dict(async_rollout=True), dict(partial_rollouts=True, over_sampling=1.5),
               dict(partial_rollouts=True, over_sampling=1.5, async_rollout=True),
               dict(async_rollout=True, resume=True), dict(partial_rollouts=True, over_sampling=1.5, resume=True)]:
        modes.check(_cfg(**kw))


def test_the_refusal_reaches_the_user_as_one_line(tmp_path):
    p = run_main(tmp_path, *RL, "--debug_train_only")
    assert p.returncode != 0 and "error: --debug_train_only trains without a rollout engine" in p.stderr
    assert "Traceback" not in p.stderr


# --- debug modes -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rollout_only_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout_only")
    return ok(run_main(out, *RL, f"--save_rollouts={out / 'rollouts'}", "--debug_rollout_only")), metrics(out), out


def test_debug_rollout_only_rolls_out_every_step_from_the_same_weights_and_never_trains(sync_run, rollout_only_run,
                                                                                       tmp_path):
    s_sum, s_rows, s_out = sync_run
    summary, rows, out = rollout_only_run
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("loss" not in r and "grad_norm" not in r for r in rows)  # nothing trained
    assert [r["weight_version"] for r in rows] == [0, 0, 0]  # nothing synced
    assert [r["weight_version"] for r in s_rows] == [0, 1, 2]
    # Step 1 is the training run's step 1 (same weights, same keys), stat for stat and token for token.
    assert {k: rows[0][k] for k in ROLLOUT_STATS} == {k: s_rows[0][k] for k in ROLLOUT_STATS}
    assert torch.equal(saved(out / "rollouts", 1)["buffer"].tokens, saved(s_out / "rollouts", 1)["buffer"].tokens)
    # Later steps draw new prompts (not step 1 again): the data cursor is the step, not the state's update count.
    assert not torch.equal(saved(out / "rollouts", 2)["buffer"].tokens, saved(out / "rollouts", 1)["buffer"].tokens)
    assert not (out / "checkpoints").exists()
    assert summary["state_hash"] == ok(run_main(tmp_path / "zero", *RL, "--num_steps=0"))["state_hash"]


def test_debug_train_only_trains_from_saved_rollouts_without_building_an_engine(sync_run, tmp_path):
    s_sum, s_rows, s_out = sync_run
    out = tmp_path / "to"
    # --rollout_backend=http would start a rollout server (and write its log) if any engine were built.
    summary = ok(run_main(out, *RL, "--debug_train_only", f"--load_rollouts={s_out / 'rollouts'}",
                          "--rollout_backend=http"))
    assert summary["state_hash"] == s_sum["state_hash"]
    assert summary["eval_success_final"] == "nan"
    assert not (out / "rollout_server.log").exists() and not (out / "rollout_weights").exists()
    drop_eval = lambda rows: [{k: v for k, v in r.items() if k != "eval_success"} for r in rows]  # noqa: E731
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]  # noqa: E731
    assert strip(metrics(out)) == drop_eval(strip(s_rows))
    assert all("eval_success" not in r for r in metrics(out))


# --- chat templates --------------------------------------------------------------------------------------------

def _tiny_chat_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # EOS is id 13 (not the character tokenizer's 2), so the test sees which one stops generation.
    chars = ["<unk>", "u", "a", ":", "|", "h", "i", "o", "1", "2", "+", "=", "<s>", "</s>"]
    vocab = {c: i for i, c in enumerate(chars)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("<s>{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
                         "{% if add_generation_prompt %}a:{% endif %}")
    tok.save_pretrained(path)
    return tok


def _engine_prompts(buf) -> list[list[int]]:
    """The prompt of each row: up to the column where the loss mask starts (it predicts the first response token)."""
    out = []
    for row, mask in zip(buf.tokens.tolist(), buf.loss_mask.tolist(), strict=True):
        out.append(row[: mask.index(1.0) + 1])
    return out


def test_prompt_data_goes_through_the_tokenizers_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = _tiny_chat_tokenizer(tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    rows = [{"input": "hi", "label": "2"}, {"input": [{"role": "user", "content": "1+1="}], "label": "2"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref_tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    expected = sorted(list(ref_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])
                      for m in ([{"role": "user", "content": "hi"}], rows[1]["input"]))
    assert expected[0] != [1] + ref_tok.encode("hi", add_special_tokens=False)  # the template is visible in the ids
    args = [*BASE, "--num_steps=1", "--sft_warmup_steps=0", "--prompts_per_step=2", f"--prompt_data={data}",
            "--debug_rollout_only"]
    out = tmp_path / "run"
    ok(run_main(out, *args, f"--tokenizer={tmp_path / 'tok'}", f"--save_rollouts={out / 'r'}"))
    got = _engine_prompts(saved(out / "r", 1)["buffer"])
    assert sorted({tuple(p) for p in got}) == [tuple(e) for e in expected]
    # --hf_checkpoint's own tokenizer is used when the checkpoint directory holds one.
    from miles_fn import prng
    from miles_fn.config import ModelConfig
    from state import hf

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=64)
    ckpt = tmp_path / "ckpt"
    hf.save_hf(str(ckpt), cfg, model.init_params(cfg, prng.key(3), 0.02))
    tok.save_pretrained(ckpt)
    out2 = tmp_path / "run2"
    ok(run_main(out2, *args, f"--hf_checkpoint={ckpt}", f"--save_rollouts={out2 / 'r'}", "--group_size=8",
                "--max_new_tokens=24"))
    buf = saved(out2 / "r", 1)["buffer"]
    assert sorted({tuple(p) for p in _engine_prompts(buf)}) == [tuple(e) for e in expected]
    # The tokenizer's EOS (13) stops generation; the character tokenizer's (2) is an ordinary token here.
    eos = ref_tok.eos_token_id
    assert eos == 13
    responses = [[t for t, m in zip(row[1:], mask, strict=True) if m]
                 for row, mask in zip(buf.tokens.tolist(), buf.loss_mask.tolist(), strict=True)]
    assert all(eos not in r[:-1] for r in responses) and any(r[-1] == eos for r in responses)
    assert any(2 in r[:-1] for r in responses)


# --- partial rollouts ------------------------------------------------------------------------------------------

class CountingEngine:
    """Prompt [L, id]: response token j is 10 + j, the L-th is EOS (2, "stop"); log-prob -(j + version / 100).
    Records every request, so the test sees what a resumed sample is continued from."""

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, requests, sampling):
        from launch.engines.base import Sample

        self.calls.append([(list(r.input_ids), r.seed, sampling.max_new_tokens) for r in requests])
        out = []
        for r in requests:
            done, target = len(r.input_ids) - 2, r.input_ids[0]
            toks = []
            for j in range(done, min(done + sampling.max_new_tokens, target)):
                toks.append(2 if j == target - 1 else 10 + j)
            out.append(Sample(toks, [-(done + i + self.version / 100) for i in range(len(toks))],
                              "stop" if toks and toks[-1] == 2 else "length", self.version))
        return out


class ListTask:
    """Prompts [L, id] in a fixed order; reward 1 when the response stops."""

    from miles_fn.tokenizer import CharTokenizer

    tokenizer = CharTokenizer()

    def __init__(self, lengths):
        self.lengths, self.next = list(lengths), 0

    def sample_pairs(self, key, n):
        out = [(self.lengths[self.next + i], self.next + i) for i in range(n)]
        self.next += n
        return out

    def prompt_ids(self, length, i):
        return [length, 20 + i]

    def reward(self, response, pair):
        return float(response[-1:] == [2])


def test_partial_rollouts_stop_at_enough_groups_and_resume_the_rest_from_their_partial_response():
    from launch import partial
    from launch.engines.base import request_seed
    from miles_fn import prng
    from miles_fn.sampling import SamplingConfig

    engine, task, pool = CountingEngine(), ListTask([2, 5, 3, 6]), partial.Pool()
    rcfg = RolloutConfig(over_sampling=2.0)
    sampling = SamplingConfig(max_new_tokens=6, stop_token_ids=(2,))
    key = prng.key(0)

    def step(s):
        return partial.collect(pool, engine, task, rcfg, sampling, prng.fold_in(key, 2 * s),
                               prng.fold_in(key, 2 * s + 1), key, 1, 1, 1)

    # Step 1: prompts L=2 and L=5 in flight, one token a round; after round 2 the L=2 group is done.
    col, last, stats = step(0)
    assert col.prompts == [[2, 20]] and col.batch.tokens == [[10, 2]] and col.batch.finish_reasons == ["stop"]
    assert stats == {"partial_rounds": 2.0, "partial_carried_groups": 1.0, "partial_resumed_frac": 0.0}
    assert len(engine.calls) == 2 and [len(c) for c in engine.calls] == [2, 2]
    carried = pool.groups[0].slots[0]
    assert carried.prompt == [5, 21] and carried.tokens == [10, 11] and carried.finish == ""  # the partial response
    # Step 2, after a weight update: the carried sample continues from prompt + partial response, first in line,
    # with a seed that depends on how far it got; the new prompt (L=3) starts from scratch.
    engine.version = 7
    col, last, stats = step(1)
    first_call = engine.calls[2]
    assert first_call[0][0] == [5, 21, 10, 11] and first_call[1][0] == [3, 22]
    assert first_call[0][1] == request_seed(prng.from_list(carried.key), 2)
    # L=3 finishes in round 3 (3 tokens), L=5 too (2 + 3 tokens): both complete, the older one is trained.
    assert col.prompts == [[5, 21]] and col.batch.tokens == [[10, 11, 12, 13, 2]]
    assert col.batch.weight_versions == [0] and last == [7]  # generated across the update
    assert col.batch.logprobs == [[-0.0, -1.0, -2.07, -3.07, -4.07]]  # each token's log-prob from its own weights
    assert col.rewards == [1.0] and stats["partial_resumed_frac"] == 1.0
    assert [s.tokens for g in pool.groups for s in g.slots] == [[10, 11, 2]]  # complete, trained next step


# A warm-up makes response lengths vary, so groups finish in different rounds and partial samples occur.
WARM = [*BASE, "--sft_warmup_steps=60", "--sft_lr=5e-3", "--sft_batch_size=16", "--max_new_tokens=8",
        "--over_sampling=2", "--partial_rollout_tokens=1"]
PARTIAL = [*WARM, "--num_steps=4", "--partial_rollouts"]


def _model_cfg():
    from miles_fn.config import ModelConfig
    from miles_fn.tokenizer import CharTokenizer

    return ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, model_type="qwen2", attention_bias=True,
                       max_position_embeddings=64)


def test_partial_rollouts_in_the_loop_record_versions_and_each_tokens_behaviour_logprob(tmp_path):
    """(A warm-up makes response lengths vary, so groups finish in different rounds and some samples are
    carried across weight updates.) Each token's engine log-prob is checked against the checkpointed
    weights of the version that generated it."""
    out = tmp_path / "p"
    ok(run_main(out, *PARTIAL, f"--save_rollouts={out / 'r'}", "--save_every=1"))
    rows = metrics(out)
    cfg, spanning, checked, wrong = _model_cfg(), 0, 0, 0
    params = lambda v: checkpoint.load(str(out / "checkpoints" / f"step_{v:08d}")).tree["state"].params  # noqa: E731
    for s in range(1, 5):
        tree = saved(out / "r", s)
        buf, first, last = tree["buffer"], tree["stats"]["sample_version_first"], tree["stats"]["sample_version_last"]
        trainer = 60 + s - 1
        assert rows[s - 1]["staleness_mean"] == pytest.approx(float((trainer - first).double().mean()))
        assert rows[s - 1]["staleness_max"] == float((trainer - first).max())
        assert bool((first <= last).all()) and bool((last <= trainer).all())
        for v in sorted(set(first.tolist()) | set(last.tolist())):
            with torch.no_grad():
                lp = model.sequence_logprobs(params(v), cfg, buf.tokens, buf.positions, buf.segment_ids)
            for i in range(buf.tokens.shape[0]):
                cols = buf.loss_mask[i].nonzero().flatten().tolist()
                assert cols == list(range(cols[0], cols[0] + len(cols)))  # every response token is trained on
                for c, ver in ((cols[0], int(first[i])), (cols[-1], int(last[i]))):
                    if ver == v:
                        assert abs(float(lp[i, c] - buf.old_logprobs[i, c])) < 1e-4
                        checked += 1
                if int(first[i]) == v < int(last[i]):  # the old weights do not explain the resumed tokens
                    wrong += abs(float(lp[i, cols[-1]] - buf.old_logprobs[i, cols[-1]])) > 1e-3
        spanning += int((first < last).sum())
    assert spanning > 0 and checked > 0 and wrong > 0
    assert any(r["partial_resumed_frac"] > 0 for r in rows)


def test_rollout_server_aborts_waiting_requests_like_sglang():
    """/abort_request by rid and /pause_generation mode "abort": the waiting call comes back with finish_reason
    "abort" and no tokens; a later call is served normally."""
    import threading
    from http.server import ThreadingHTTPServer

    from launch import rollout_server
    from launch.engines.sglang_client import SGLangClient
    from miles_fn import prng
    from miles_fn.config import ModelConfig

    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                      max_position_embeddings=64)
    state = rollout_server.RolloutState(cfg, model.init_params(cfg, prng.key(0), 0.3), 5)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), rollout_server.make_handler(state))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    client = SGLangClient(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=30)
    body = {"input_ids": [[1, 2, 3], [1, 4]], "sampling_params": {"max_new_tokens": 4, "sampling_seed": 7},
            "rid": ["a", "b"]}
    try:
        for abort in (lambda: client.abort_request("b"), lambda: client.pause_generation("abort")):
            client.pause_generation("in_place")
            replies = []
            t = threading.Thread(target=lambda out=replies: out.append(client.call("POST", "/generate", body)))
            t.start()
            while not state.waiting:  # the call is parked behind the pause
                t.join(0.01)
            client.abort_request("no-such-rid")  # unknown: a no-op
            assert state.waiting and not state.aborted
            abort()
            t.join(30)
            assert [r["meta_info"]["finish_reason"]["type"] for r in replies[0]] == ["abort", "abort"]
            assert all(r["output_ids"] == [] for r in replies[0])
            client.continue_generation()
        out = client.call("POST", "/generate", body)
        assert [r["meta_info"]["finish_reason"]["type"] in ("stop", "length") for r in out] == [True, True]
        assert [len(r["output_ids"]) for r in out] != [0, 0] and out[0]["meta_info"]["weight_version"] == "5"
    finally:
        client.close()
        srv.shutdown()
        srv.server_close()


# --- async rollout ---------------------------------------------------------------------------------------------

def test_async_rollout_is_one_step_off_policy_by_version_and_deterministic(sync_run, rollout_only_run, tmp_path):
    s_sum, s_rows, s_out = sync_run
    runs = [tmp_path / "a1", tmp_path / "a2"]
    sums = [ok(run_main(out, *RL, "--async_rollout", f"--save_rollouts={out / 'r'}")) for out in runs]
    assert (runs[0] / "metrics.jsonl").read_bytes() == (runs[1] / "metrics.jsonl").read_bytes()
    assert sums[0]["state_hash"] == sums[1]["state_hash"] != s_sum["state_hash"]
    rows = metrics(runs[0])
    # Step k+1's samples come from the weights before step k's update: versions 0, 0, 1 (sync: 0, 1, 2).
    assert [r["weight_version"] for r in rows] == [0, 0, 1]
    assert [(r["staleness_mean"], r["staleness_max"]) for r in rows] == [(0, 0), (1, 1), (1, 1)]
    # Step 1 is the synchronous step 1 in every seed-determined value.
    same = {k for k in s_rows[0] if not k.startswith("time_")}
    assert {k: rows[0][k] for k in same} == {k: s_rows[0][k] for k in same}
    # Step 2 was generated by the version-0 weights: exactly the rollout-only run's step 2, not the sync run's.
    a2, ro2, s2 = (saved(d, 2)["buffer"] for d in (runs[0] / "r", rollout_only_run[2] / "rollouts", s_out / "rollouts"))
    assert torch.equal(a2.tokens, ro2.tokens) and torch.equal(a2.old_logprobs, ro2.old_logprobs)
    assert not torch.equal(a2.old_logprobs, s2.old_logprobs)


def test_resume_carries_the_rollout_ahead_and_the_unfinished_samples(tmp_path):
    """Both modes at once (each carry alone breaks it): a run stopped after step 2 and resumed to step 4 writes
    byte for byte the straight run's metrics (--eval_every=2: the stopped run evaluates at its last step)."""
    mode = ["--partial_rollouts", "--async_rollout"]
    args = [*WARM, "--num_steps=4", "--eval_every=2", "--save_every=100", *mode]
    straight, split = tmp_path / "straight", tmp_path / "split"
    a = ok(run_main(straight, *args))
    ok(run_main(split, *args, "--num_steps=2"))
    b = ok(run_main(split, *args, "--resume"))
    assert a["state_hash"] == b["state_hash"]
    assert (straight / "metrics.jsonl").read_bytes() == (split / "metrics.jsonl").read_bytes()
    rows = metrics(straight)
    assert rows[1]["staleness_max"] >= 1
    assert any(r["partial_resumed_frac"] > 0 for r in rows[2:])


def test_partial_and_async_rollouts_over_http_match_the_embedded_engine(tmp_path):
    """The rounds' calls (budgets differ per round) and the background thread's calls through the rollout server."""
    args = [*WARM, "--num_steps=3", "--partial_rollouts", "--async_rollout", "--rollout_batch_size=3"]
    a = ok(run_main(tmp_path / "embedded", *args))
    b = ok(run_main(tmp_path / "http", *args, "--rollout_backend=http"))
    assert a["state_hash"] == b["state_hash"]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]  # noqa: E731
    assert strip(metrics(tmp_path / "embedded")) == strip(metrics(tmp_path / "http"))
    assert (tmp_path / "http" / "rollout_server.log").exists()
