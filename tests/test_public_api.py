"""The public surface: everything in ``torchforge.__all__`` imports and is documented.

Generic over ``torchforge.__all__`` and over the primitive modules that exist, so it keeps
checking new modules as they are added.
"""

import ast
import importlib
import importlib.util
import inspect
import re
import sys

import pytest

import torchforge
import torchforge.batch
from torchforge.batch import Batch

# The primitive layer of DESIGN.md; modules not written yet are skipped.
BATCH_KEYS = set(Batch.__dataclass_fields__) - {"batch_size"}
PRIMITIVE_MODULES = (
    "log_probs", "kl", "advantages", "returns", "ratios", "losses", "trust_region_losses", "covariance_losses",
    "value_losses", "corrections", "entropy_selection", "reward_shaping", "reduce", "batch", "errors",
)
# What a primitive may import besides the standard library and other primitives.
PRIMITIVE_DEPENDENCIES = {"torch", "tensordict", "einops"}
# Modules that provide the machinery rather than primitives that take batches.
MACHINERY_MODULES = {"batch", "errors"}

EXPORTED = list(torchforge.__all__)


def _existing_primitive_modules():
    names = [f"torchforge.{m}" for m in PRIMITIVE_MODULES]
    return [n for n in names if importlib.util.find_spec(n) is not None]


def _module_public_names(module):
    """The module's ``__all__``, else its non-underscore functions and classes."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", None) == module.__name__
    ]


def _is_documented_callable(obj):
    """Functions and classes, excluding exception classes; constants are not callables."""
    if inspect.isclass(obj):
        return not issubclass(obj, BaseException)
    return inspect.isroutine(obj)


def _has_section(doc, section):
    return re.search(rf"^\s*{section}:\s*$", doc, flags=re.MULTILINE) is not None


def test_all_has_no_duplicates_and_every_name_imports():
    assert len(EXPORTED) == len(set(EXPORTED)), sorted(n for n in EXPORTED if EXPORTED.count(n) > 1)
    for name in EXPORTED:
        assert hasattr(torchforge, name), f"torchforge.__all__ lists {name!r} but torchforge has no such attribute"
        namespace = {}
        exec(f"from torchforge import {name}", namespace)  # the way users import it
        assert namespace[name] is getattr(torchforge, name)


def test_star_import_gives_exactly_all():
    namespace = {}
    exec("from torchforge import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(EXPORTED)


@pytest.mark.parametrize("name", [n for n in EXPORTED if _is_documented_callable(getattr(torchforge, n))])
def test_public_callable_has_args_and_returns(name):
    obj = getattr(torchforge, name)
    doc = inspect.getdoc(obj) if inspect.isroutine(obj) else obj.__dict__.get("__doc__")
    assert doc, f"torchforge.{name} has no docstring"
    doc = inspect.cleandoc(doc)
    for section in ("Args", "Returns"):
        assert _has_section(doc, section), f"torchforge.{name}: docstring has no '{section}:' section"


@pytest.mark.parametrize("module_name", _existing_primitive_modules())
def test_every_public_name_of_a_primitive_module_is_exported(module_name):
    module = importlib.import_module(module_name)
    missing = [n for n in _module_public_names(module) if n not in EXPORTED]
    assert not missing, f"{module_name} has public names missing from torchforge.__all__: {missing}"
    # ... and its __all__ names exist
    for name in _module_public_names(module):
        assert hasattr(module, name), f"{module_name}.__all__ lists {name!r}, which it does not define"
    # every non-underscore function or class defined in the module is in its own __all__
    defined = [
        n for n, obj in vars(module).items()
        if not n.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", None) == module_name
        and getattr(obj, "__name__", n) == n
    ]
    unlisted = [
        n for n in defined if n not in _module_public_names(module) and not _is_internal_helper(module_name, n)
    ]
    assert not unlisted, f"{module_name} defines public functions not in its __all__: {unlisted}"


def _is_internal_helper(module_name, name):
    # errors.py's check_* helpers (and shape_str) are the library's own validation tools.
    return module_name == "torchforge.errors" and (name.startswith("check_") or name == "shape_str")


def _primitive_functions():
    out = []
    for module_name in _existing_primitive_modules():
        if module_name.rsplit(".", 1)[1] in MACHINERY_MODULES:
            continue
        module = importlib.import_module(module_name)
        for name in _module_public_names(module):
            obj = getattr(module, name, None)
            if inspect.isfunction(obj):
                out.append(pytest.param(obj, id=f"{module_name}.{name}"))
    return out


def _is_batch_args_wrapper(fn):
    code = getattr(fn, "__code__", None)
    return (
        hasattr(fn, "__wrapped__")
        and code is not None
        and code.co_filename == torchforge.batch.__file__
        and code.co_name == "wrapper"
    )


@pytest.mark.parametrize("fn", _primitive_functions())
def test_primitive_signature_conventions(fn):
    # A primitive takes a Batch / TensorDict first (@batch_args) exactly when its tensors
    # really are batch keys (or the model outputs logits / hidden): the reductions take
    # any values (masked_mean(batch) must not silently read `values`), and a function of
    # entropy, lengths or a coefficient is not batch-called. No *args / **kwargs; every
    # boolean or string hyperparameter is keyword-only.
    first = next(iter(inspect.signature(fn).parameters))
    batch_called = fn.__module__ != "torchforge.reduce" and first in BATCH_KEYS | {"logits", "hidden"}
    assert _is_batch_args_wrapper(fn) == batch_called, (
        f"{fn.__name__}({first}, ...): @batch_args expected {batch_called}"
    )
    for param in inspect.signature(fn).parameters.values():
        assert param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD), (
            f"{fn.__name__}: *{param.name} / **{param.name} in a primitive"
        )
        if isinstance(param.default, (bool, str)):
            assert param.kind is param.KEYWORD_ONLY, (
                f"{fn.__name__}: {param.name}={param.default!r} must be keyword-only"
            )


@pytest.mark.parametrize("module_name", _existing_primitive_modules())
def test_primitive_imports_only_the_layers_above(module_name):
    # DESIGN.md: primitives use torch, tensordict and einops only (and each other); never
    # the loop, the trainer, transformers or torch.distributed.
    path = importlib.util.find_spec(module_name).origin
    with open(path) as f:
        tree = ast.parse(f.read())
    allowed_local = {f"torchforge.{m}" for m in PRIMITIVE_MODULES}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for full in names:
            top = full.split(".")[0]
            if top == "torchforge":
                assert full in allowed_local or full == "torchforge", f"{module_name} imports {full}"
            else:
                assert top in PRIMITIVE_DEPENDENCIES or top in sys.stdlib_module_names or top == "__future__", (
                    f"{module_name} imports {full}"
                )
                assert not full.startswith("torch.distributed"), f"{module_name} imports {full}"


@pytest.mark.parametrize("name", [n for n in EXPORTED if _is_documented_callable(getattr(torchforge, n))])
def test_public_callable_has_an_example(name):
    obj = getattr(torchforge, name)
    doc = inspect.getdoc(obj) if inspect.isroutine(obj) else obj.__dict__.get("__doc__")
    assert _has_section(inspect.cleandoc(doc), "Example"), f"torchforge.{name}: docstring has no 'Example:' section"


def test_the_loop_exports_its_vision_names():
    # torchforge.loop re-exports its modules' public names; the vision ones among them
    import torchforge.loop
    import torchforge.loop.vision

    loop_all = list(torchforge.loop.__all__)
    assert len(loop_all) == len(set(loop_all)), sorted(n for n in loop_all if loop_all.count(n) > 1)
    missing = [n for n in torchforge.loop.vision.__all__ if n not in loop_all]
    assert not missing, f"torchforge.loop.vision has public names missing from torchforge.loop.__all__: {missing}"
    for name in loop_all:
        assert hasattr(torchforge.loop, name), f"torchforge.loop.__all__ lists {name!r}, which it does not define"
    for name in torchforge.loop.vision.__all__:
        assert getattr(torchforge.loop, name) is getattr(torchforge.loop.vision, name)
