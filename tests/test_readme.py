"""The README's code runs: every ```python block except those that load a model from a path."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
# needs a real model folder and a user's dataset: shown for reading, run in tests/trainer/test_trainer.py
# against the tiny local model (test_card_quick_start_runs_as_written)
RUNNABLE = [b for b in BLOCKS if "path/to/local/model" not in b]


def test_the_readme_has_runnable_examples():
    assert len(RUNNABLE) >= 3 and len(BLOCKS) > len(RUNNABLE)


@pytest.mark.parametrize("code", RUNNABLE, ids=lambda b: b.strip().splitlines()[-1][:40])
def test_readme_block_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})


def test_readme_names_every_public_function():
    import torchforge

    text = README.read_text()
    missing = [n for n in torchforge.__all__ if n.islower() and f"`{n}" not in text and f"{n}`" not in text
               and f", `{n}`" not in text]
    assert not missing, missing


# --- the set-up commands ----------------------------------------------------------------------

def test_the_cpu_only_pytorch_line_comes_before_the_two_set_up_commands():
    bash = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert bash[0].strip() == "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert bash[1].strip() == "pip install -e . && torchforge train"
    assert bash[2].strip() == 'pip install -e ".[dev]" && python -m pytest'


# --- every recipe row's code runs ------------------------------------------------------------

def _recipe_rows() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text[text.index("## Algorithm recipes"):]
    section = section[:section.index("\n## ", 1)]
    table = section[section.index("| algorithm |"):]
    table = table[:table.index("\n\n")]  # the first table of the section
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0], cells[1]))
    return rows


RECIPES = _recipe_rows()


def _inputs() -> dict:
    """What a recipe's names stand for: a batch of B = 8 sequences (G = 4) of T = 6 tokens."""
    import math

    import torch

    import torchforge as tf

    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    mask = torch.arange(T) < torch.tensor([6, 5, 4, 6, 3, 6, 2, 5])[:, None]
    log_probs = -torch.rand(B, T, generator=g) - 0.1
    values = dict(
        G=4, β=0.05, L=T, l=2, g=g, math=math, torch=torch, tf=tf, mask=mask,
        B=B, T=T, rewards=(torch.rand(B, generator=g) < 0.5).float(), baseline_rewards=torch.rand(B, generator=g),
        log_probs=log_probs.requires_grad_(), old_log_probs=log_probs.detach() + 0.05 * torch.randn(B, T, generator=g),
        ref_log_probs=log_probs.detach() - 0.1, rollout_log_probs=log_probs.detach() + 0.1,
        values=torch.randn(B, T, generator=g), old_values=torch.randn(B, T, generator=g),
        returns=torch.randn(B, T, generator=g), advantages=torch.randn(B, generator=g),
        entropy=torch.rand(B, T, generator=g), lengths=mask.sum(-1), kl_coef=0.1,
        metrics={"kl": torch.tensor(0.02)}, target=0.01, horizon=100, num_steps=1,
        # the values a row leaves to the reader ("..."), and its other symbols
        clip_low=0.2, clip_high=0.28, quantile=0.8, k=2, r=torch.rand(B, generator=g),
        rewards_BK=torch.rand(B, 2, generator=g), w=[0.7, 0.3],
    )
    return values


def _call(node, names: dict, previous=None):
    """Evaluate one ``fn(...)`` of a recipe: arguments it leaves out come from ``names`` (by
    parameter name), ``...`` means "the default", and the previous call's result of a
    ``→`` chain is its first argument."""
    import ast
    import inspect

    fn = eval(compile(ast.Expression(node.func), "README", "eval"), names)
    args = [eval(compile(ast.Expression(a), "README", "eval"), names) for a in node.args]
    kwargs = {k.arg: eval(compile(ast.Expression(k.value), "README", "eval"), names) for k in node.keywords}
    try:
        parameters = inspect.signature(fn).parameters
    except ValueError:  # a builtin method: `.sum()`
        return fn(*args, **kwargs)
    unknown = set(kwargs) - set(parameters)
    assert not unknown, f"{ast.unparse(node)}: {sorted(unknown)} are not keywords of {fn.__name__}"
    if args and args[0] is Ellipsis:  # "f(..., x=1)": the usual tensors
        args = []
    for name in [k for k, v in kwargs.items() if v is Ellipsis]:
        del kwargs[name]
        if name in names:
            kwargs[name] = names[name]
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if previous is not None and not args:
        args = [previous]
    for p in positional[len(args):]:
        if p.name not in kwargs and (p.default is p.empty or p.default is None and p.name in _BATCH_KEYS):
            kwargs[p.name] = names[p.name]
    for p in parameters.values():
        if p.kind == p.KEYWORD_ONLY and p.name not in kwargs and p.default is p.empty:
            kwargs[p.name] = names[p.name]
    return fn(*args, **kwargs)


_BATCH_KEYS = ("ref_log_probs", "rollout_log_probs", "old_values", "returns", "values")


def _evaluate(tree, names: dict, previous=None):
    """Run a span: every call in it through :func:`_call` (innermost first), then the rest."""
    import ast

    class Calls(ast.NodeTransformer):
        def visit_Call(self, node):
            self.generic_visit(node)
            key = f"_call_{len(names)}"
            top = node is tree.body[0].value
            names[key] = _call(node, names, previous if top else None)
            return ast.copy_location(ast.Name(id=key, ctx=ast.Load()), node)

    statement = tree.body[0]
    statement.value = Calls().visit(statement.value)
    if isinstance(statement, ast.Assign):
        exec(compile(ast.fix_missing_locations(tree), "README", "exec"), names)
        return names[ast.unparse(statement.targets[0])]
    return eval(compile(ast.fix_missing_locations(ast.Expression(statement.value)), "README", "eval"), names)


def _spans(cell: str) -> list[tuple[str, bool]]:
    """The code spans of a cell, each with whether it continues a ``→`` chain."""
    out, last_end = [], 0
    for match in re.finditer(r"`([^`]+)`", cell):
        chained = "→" in cell[last_end:match.start()] and out != []
        out.append((match.group(1), chained))
        last_end = match.end()
    return out


@pytest.mark.parametrize("name, cell", RECIPES, ids=[r[0] for r in RECIPES])
def test_every_recipe_row_runs_as_written(name, cell):
    import ast

    import torchforge as tf

    names = {**{n: getattr(tf, n) for n in tf.__all__}, **_inputs()}
    ran, previous = 0, None
    for code, chained in _spans(cell):
        try:
            tree = ast.parse(code)
        except SyntaxError:
            previous = None
            continue  # a name or a keyword, not a call: `gae`, `weights=`
        statement = tree.body[0]
        value = statement.value if isinstance(statement, (ast.Expr, ast.Assign)) else None
        if value is None or not any(isinstance(n, ast.Call) for n in ast.walk(value)) and not isinstance(
                statement, ast.Assign):
            previous = None
            continue  # a name: `gae`
        result = _evaluate(tree, names, previous if chained else None)
        previous = result[0] if isinstance(result, tuple) else result
        ran += 1
    if ran == 0:
        pytest.skip(f"{name}: prose, no call")


def test_the_metric_names_in_the_readme_are_the_logged_ones(tmp_path):
    from torchforge import RLConfig, RLTrainer

    trainer = RLTrainer(config=RLConfig(max_steps=1, num_generations=2, prompts_per_step=2, max_completion_length=3,
                                        kl_coef=0.1, mixed_precision="fp32", gradient_checkpointing=False,
                                        progress_bar=False, output_dir=str(tmp_path)))
    logged = set(trainer.train_step(0))
    text = README.read_text()
    listed = text[text.index("- Every step logs TRL-style metrics"):]
    listed = listed[:listed.index("\n- ", 1)]
    names = set()
    for name in re.findall(r"`([^`]+)`", listed):
        if name.endswith("/low/high") or name.endswith("_low/high"):
            stem = name.rsplit("/", 2)[0] if name.endswith("/low/high") else name[: -len("low/high")]
            names |= {stem + "low", stem + "high"}
        elif "/" in name or re.fullmatch(r"[a-z_]+", name):
            names.add(name.replace("<fn>", "copy_digits"))
    names = {n for n in names if not n.endswith((".jsonl", "tensorboard"))}
    assert names - logged == set(), "the README lists metrics that are not logged"
    assert {k for k in logged if not k.startswith("rewards/")} - names == set(), "logged metrics the README omits"
