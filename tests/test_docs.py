"""The README and docs/ stay true to the tree: links resolve, and the commands, modules, make targets, flags and
paths they name exist; the README's research-API block runs and gives the example's update.

Flags are checked by context. In a code span, or a line of a code block (backslash continuations joined), a
`--flag` after `python -m MODULE` or `python path.py` must be one that program defines: absl `DEFINE_*("name"`
or a `"--name"` string (argparse, sys.argv checks) in its file or in the repo modules it imports directly, plus
the builtins of absl or argparse. A `--flag` with no command before it is the main job's (`launch.main`) when it
is snake_case, and the rollout server's (`launch.rollout_server`, SGLang's spelling) when it has a dash. Flags
of programs outside the repo (pytest, SGLang's launcher) are not checked.
"""

from __future__ import annotations

import glob
import importlib.util
import pathlib
import re
from functools import cache

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS_PAGES = {"quickstart", "algorithms", "determinism", "true-on-policy", "packing-and-memory", "rollout",
              "performance", "reliability", "distributed", "speculative-decoding", "models"}
REPO_DIRS = ("miles_fn", "ops", "state", "launch", "tests", "bench", "examples", "docs", "third_party")
# absl's own flags (absl.flags and absl.app define them, not the repo) and argparse's.
ABSL_BUILTINS = {"flagfile", "undefok", "help", "helpshort", "helpfull", "helpxml", "only_check_args"}
ARGPARSE_BUILTINS = {"help"}

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
COMMAND = re.compile(r"\bpython3?\s+(?:-m\s+(?P<mod>[A-Za-z_][\w.]*)|(?P<script>(?:[\w.-]+/)*[\w.-]+\.py))"
                     r"|(?:^|(?<=[\s;&|(]))make\s+(?P<target>[A-Za-z_][\w-]*)"
                     r"|\btorchrun\b[^\n`]*?\s-m\s+(?P<tmod>[A-Za-z_][\w.]*)")  # torchrun's own flags, then MOD's
FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)")
_DIRS = "|".join(REPO_DIRS)
REPO_PATH = re.compile(r"(?<![\w./~-])((?:" + _DIRS + r")/[\w./{},*-]*)")
SPEC = re.compile(r"(?<![\w.])((?:" + _DIRS + r")(?:\.\w+)+):(\w+)")


def read(page: pathlib.Path) -> str:
    return page.read_text(encoding="utf-8")


def rel(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def prose(text: str) -> str:
    """The text outside code blocks and code spans (where links live)."""
    return SPAN.sub(" ", FENCE.sub("\n", text))


def code_contexts(text: str) -> list[str]:
    """Each code span, and each logical line of each code block: the units a command's flags belong to."""
    out = []
    for block in FENCE.findall(text):
        out.extend(block.replace("\\\n", " ").splitlines())
    out.extend(m.group(2) for m in SPAN.finditer(FENCE.sub("\n", text)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in HEADING.findall(FENCE.sub("\n", read(page))):
        s = slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def module_file(module: str) -> pathlib.Path | None:
    """The repo file of a dotted module (or package), if the module is the repo's."""
    base = ROOT.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__main__.py", base / "__init__.py"):
        if f.is_file():
            return f
    return None


def imported_files(src: str, here: pathlib.Path) -> list[pathlib.Path]:
    """Repo files that `src` imports directly (`import a.b`, `from a import b, c as d`, `from a.b import x`)."""
    out = []
    for mod, names in re.findall(r"^\s*from\s+([\w.]+)\s+import\s+\(?([^)\n]*)", src, re.M):
        for cand in [mod, *(f"{mod}.{n.split()[0]}" for n in names.split(",") if n.strip())]:
            f = module_file(cand)
            if f is not None and f != here:
                out.append(f)
    for mods in re.findall(r"^\s*import\s+([\w., ]+)", src, re.M):
        for m in mods.split(","):
            f = module_file(m.split()[0]) if m.strip() else None
            if f is not None and f != here:
                out.append(f)
    return out


@cache
def cli_flags(path: pathlib.Path) -> tuple[frozenset[str], frozenset[str]]:
    """(every flag the program at `path` accepts, its absl booleans, which also take --noNAME)."""
    src = path.read_text(encoding="utf-8")
    names, bools = set(), set()
    uses_absl = bool(re.search(r"^\s*from\s+absl\s+import|^\s*import\s+absl", src, re.M))
    names |= set(re.findall(r"[\"']--([\w-]+)[\"']", src))  # its own argparse options and sys.argv checks
    for f in [path, *imported_files(src, path)]:  # flags defined where it imports them from
        text = f.read_text(encoding="utf-8")
        names |= set(re.findall(r"DEFINE_\w+\(\s*[\"']([\w-]+)[\"']", text))
        bools |= set(re.findall(r"DEFINE_bool(?:ean)?\(\s*[\"']([\w-]+)[\"']", text))
        names |= set(re.findall(r"add_argument\(\s*[\"']--([\w-]+)[\"']", text))
    names |= ABSL_BUILTINS if uses_absl else ARGPARSE_BUILTINS
    return frozenset(names), frozenset(bools)


def accepts(path: pathlib.Path, flag: str) -> bool:
    names, bools = cli_flags(path)
    return flag in names or (flag.startswith("no") and flag[2:] in bools)


def external_module_ok(module: str) -> bool:
    """An installed module, or one of an optional extra of pyproject.toml (SGLang's launcher on a GPU machine)."""
    try:
        if importlib.util.find_spec(module) is not None:
            return True
    except ModuleNotFoundError:
        pass
    extras = re.search(r"\[project\.optional-dependencies\](.*?)(?:^\[|\Z)", read(ROOT / "pyproject.toml"),
                       re.S | re.M)
    top = module.split(".")[0]
    return bool(extras) and re.search(rf"[\"']{re.escape(top)}[<>=~!\[\"' ]", extras.group(1)) is not None


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z_][\w-]*)\s*:(?!=)", read(ROOT / "Makefile"), re.M))


MAIN = ROOT / "launch" / "main.py"
SERVER = ROOT / "launch" / "rollout_server.py"


def check_context(ctx: str, targets: set[str]) -> list[str]:
    """What `ctx` (one code span or code line) names that does not exist."""
    bad = []
    commands = []  # (start, program file or None for outside the repo, label)
    for m in COMMAND.finditer(ctx):
        if m.group("tmod"):
            commands.append((m.start(), None, "torchrun"))  # flags up to -m are torchrun's
            commands.append((m.start("tmod"), module_file(m.group("tmod")), m.group("tmod")))
            if module_file(m.group("tmod")) is None:
                bad.append(f"torchrun -m {m.group('tmod')}: no such module in the repo")
        elif m.group("target"):
            if m.group("target") not in targets:
                bad.append(f"make target {m.group('target')!r} is not in the Makefile")
            commands.append((m.start(), None, "make"))
        elif m.group("mod"):
            mod = m.group("mod")
            f = module_file(mod)
            if f is None and not external_module_ok(mod):
                bad.append(f"python -m {mod}: no such module in the repo or installed")
            commands.append((m.start(), f, mod))
        else:
            f = ROOT / m.group("script")
            if not f.is_file():
                bad.append(f"python {m.group('script')}: no such file")
            commands.append((m.start(), f if f.is_file() else None, m.group("script")))
    for m in FLAG.finditer(ctx):
        flag = m.group(1)
        before = [c for c in commands if c[0] < m.start()]
        if before:
            _, prog, label = before[-1]
            if prog is not None and not accepts(prog, flag):
                bad.append(f"--{flag} is not a flag of {label}")
        elif "-" in flag:
            if not accepts(SERVER, flag):
                bad.append(f"--{flag} is not a flag of launch.rollout_server (nor SGLang-style)")
        elif not accepts(MAIN, flag):
            bad.append(f"--{flag} is not a flag of launch.main (launch/flags.py)")
    for m in REPO_PATH.finditer(ctx):
        path = m.group(1).rstrip(".,;:)")
        for p in expand_braces(path):
            if not glob.glob(str(ROOT / p)):
                bad.append(f"path {p} does not exist")
    for mod, fn in SPEC.findall(ctx):
        f = module_file(mod)
        if f is None:
            bad.append(f"{mod}:{fn}: no module {mod}")
        elif not re.search(rf"^def {fn}\(", read(f), re.M):
            bad.append(f"{mod}:{fn}: {rel(f)} defines no function {fn}")
    return bad


def expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in expand_braces(path[:m.start()] + alt + path[m.end():])]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    bad = []
    for target in LINK.findall(prose(read(page))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not bad, f"{rel(page)}:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_named_commands_modules_targets_flags_and_paths_exist(page):
    targets = makefile_targets()
    bad = [b for ctx in code_contexts(read(page)) for b in check_context(ctx, targets)]
    assert not bad, f"{rel(page)}:\n  " + "\n  ".join(sorted(set(bad)))


def test_the_checker_catches_what_it_is_for():
    targets = makefile_targets()
    assert check_context("make run", targets) == [] and check_context("make deploy", targets)
    assert check_context("python -m launch.main --flagfile=x --noprogress --num_steps=3", targets) == []
    assert check_context("python -m launch.main --num_stepz=3", targets)
    assert check_context("python -m launch.nothing_here", targets)
    assert check_context("python -m bench.packing --fixed_order", targets) == []
    assert check_context("python -m bench.packing --fixed_orderr", targets)
    assert check_context("--decode-backend", targets) == [] and check_context("--decode-backendd", targets)
    assert check_context("--nolr", targets), "--no is only for boolean flags"
    assert check_context("miles_fn/no_such_file.py", targets) and check_context("miles_fn/packing.py", targets) == []
    assert check_context("examples.composed_loss:make_loss", targets) == []
    assert check_context("examples.composed_loss:make_lost", targets)
    assert slug("True on-policy: gradient tiles") == "true-on-policy-gradient-tiles"
    assert slug("The C decode kernel (CPU)") == "the-c-decode-kernel-cpu"


def test_readme_is_short_starts_with_the_two_commands_and_maps_every_page():
    text = read(ROOT / "README.md")
    assert len(text.splitlines()) <= 150, "the README is the front page; reference material goes under docs/"
    first_block = FENCE.search(text).group(1).splitlines()
    assert [ln.split()[:2] for ln in first_block] == [["make", "run"], ["make", "test"]]
    assert {"run", "test"} <= makefile_targets()
    assert "docs/img/reward_curve.png" in text
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert pages == DOCS_PAGES, f"docs/ pages changed: {sorted(pages ^ DOCS_PAGES)}"
    linked = {pathlib.Path(t.partition("#")[0]).stem for t in LINK.findall(prose(text)) if t.startswith("docs/")}
    assert DOCS_PAGES <= linked, f"README does not link {sorted(DOCS_PAGES - linked)}"


@pytest.mark.parametrize("name", sorted(DOCS_PAGES))
def test_every_page_says_what_is_tested(name):
    text = read(ROOT / "docs" / f"{name}.md")
    assert re.search(r"^#+ What is tested|What is tested:", text, re.M), f"docs/{name}.md says nothing of its tests"
    assert "../README.md" in text


def test_reliability_keeps_its_checked_inputs_section():
    assert "checked-inputs" in anchors(ROOT / "docs" / "reliability.md")


def test_readme_research_api_block_runs_and_equals_the_example():
    import torch

    from examples import custom_loss
    from miles_fn import model, prng, train
    from miles_fn.config import ModelConfig
    from miles_fn.generate import generate
    from miles_fn.optim import OptimConfig
    from miles_fn.rollout_buffer import build_rollout_buffer
    from miles_fn.sampling import SamplingConfig
    from miles_fn.tasks.addition import AdditionTask
    from state.tree import tree_hash

    blocks = re.findall(r"^```python\n(.*?)^```", read(ROOT / "README.md"), re.S | re.M)
    block = next(b for b in blocks if "train.train_step" in b)
    task, group = AdditionTask(digits=1), 4
    tok = task.tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=32)
    root = prng.key(3)
    state = train.init_state(model.init_params(cfg, prng.fold_in(root, 0)), root)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=task.max_answer_tokens, stop_token_ids=(tok.eos_id,))
    pairs = task.sample_pairs(prng.fold_in(root, 1), 4)
    ids = [task.prompt_ids(*p) for p in pairs for _ in range(group)]
    gen = generate(state.params, cfg, ids, prng.fold_in(root, 2), sampling)
    rewards = [custom_loss.partial_credit(task, r, pairs[i // group]) for i, r in enumerate(gen.tokens)]
    rewards[0] = 1.0 - rewards[0]  # a group whose rewards differ, so the update is not zero
    batch = build_rollout_buffer(ids, gen.tokens, gen.logprobs, rewards, [i // group for i in range(len(ids))])
    key = prng.fold_in(root, 4)

    ns = {"state": state, "batch": batch, "key": key, "cfg": cfg}
    exec(compile(block, "README.md", "exec"), ns)  # the README's own code
    want, _ = train.train_step(state, batch, key, custom_loss.make_rloo_loss(cfg), OptimConfig(lr=3e-3))
    assert torch.isfinite(ns["metrics"]["loss"])
    assert tree_hash(ns["state"]) != tree_hash(state), "the README's step changed nothing"
    assert tree_hash(ns["state"]) == tree_hash(want), "the README's RLOO is not the example's"
