"""``torchforge.compat`` and its submodules import without verl or trl, and without importing them.

Runs in the main suite (where the peers are absent), each import in a fresh interpreter with
the peers made unimportable, so a stray ``import verl`` fails here rather than in a user's
environment that lacks it.
"""

import subprocess
import sys
import textwrap

import pytest

import torchforge.compat

PEERS = ("verl", "trl")


@pytest.mark.parametrize("module", ["torchforge.compat", *(f"torchforge.compat.{m}" for m in torchforge.compat.SUBMODULES)])
def test_compat_imports_without_the_peers(module):
    code = textwrap.dedent(f"""
        import importlib.abc, sys

        class Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {PEERS!r}:
                    raise ImportError(f"{{name}} is blocked in this test")

        sys.meta_path.insert(0, Blocked())
        import {module}
        from torchforge.compat import verl, trl  # the one-import swap, both peers
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {PEERS!r})
        assert not loaded, loaded
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_compat_submodules_are_imported_on_first_access():
    assert set(torchforge.compat.__all__) == set(torchforge.compat.SUBMODULES)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        torchforge.compat.nope  # noqa: B018
