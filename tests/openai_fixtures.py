"""Shared by the OpenAI-API and fleet tests: a tiny checkpoint with a real Hugging Face tokenizer (one id per
character, with a chat template), rollout servers on loopback, and the real sglang-router in front of them."""

from __future__ import annotations

import os
import sys

import torch

from launch.engines.fleet import Router, router_command
from launch.engines.remote import ServerProcess
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from miles_fn.tokenizer import CharTokenizer
from state import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHARS = CharTokenizer()
CFG = ModelConfig(vocab_size=CHARS.vocab_size, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=96)
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }},{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


def save_checkpoint(path: str, seed: int = 0) -> str:
    """config.json + safetensors + a character-level tokenizer (WordLevel, the CharTokenizer's ids) with TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf.save_hf(path, CFG, model.init_params(CFG, prng.key(seed), 0.3))
    t = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS.vocab)}, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<pad>", pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def server(ckpt: str, log: str, *extra: str) -> ServerProcess:
    def command(port: int, first: bool) -> list[str]:
        return [sys.executable, "-m", "launch.rollout_server", "--model-path", ckpt, "--port", str(port),
                "--num-threads", str(min(torch.get_num_threads(), 2)), "--watch-parent", *extra]

    return ServerProcess(command, log, start_timeout_s=60, cwd=ROOT)


def router(urls: list[str], log: str, policy: str = "round_robin") -> tuple[ServerProcess, Router]:
    proc = ServerProcess(lambda port, first: router_command(port, urls, policy), log, start_timeout_s=60, cwd=ROOT)
    r = Router(proc.start(), 30.0, proc)
    r.wait_for(urls, 60)
    return proc, r
