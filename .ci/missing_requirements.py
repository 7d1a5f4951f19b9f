"""Print torchforge's requirements (its dependencies and the test runner's) that this
environment does not satisfy, one per argument, for ``pip install``: the compat environment
installs the pinned peer set --no-deps first, then only what that set lacks."""

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

TEST_REQUIREMENTS = ("pytest", "hypothesis")  # of the dev extra, what tests/compat runs on

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
dev = {Requirement(r).name: r for r in project["optional-dependencies"]["dev"]}
wanted = list(project["dependencies"]) + [dev[name] for name in TEST_REQUIREMENTS]
for line in wanted:
    requirement = Requirement(line)
    try:
        installed = version(requirement.name)
    except PackageNotFoundError:
        installed = None
    if installed is None or not requirement.specifier.contains(re.sub(r"\+.*", "", installed), prereleases=True):
        print(line)
