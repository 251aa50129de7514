"""Print the requirements pyproject.toml declares, one a line, for an environment that installs s4accel itself with
`--no-deps` (`make test-floor`: torch's floor pins a Triton older than the one the `dev` extra asks for).

    python tests/scripts/requirements.py [EXTRA ...] [--except NAME ...]
"""

import re
import sys
import tomllib
from pathlib import Path

args = sys.argv[1:]
skip = set(args[args.index("--except") + 1:]) if "--except" in args else set()
extras = args[:args.index("--except")] if "--except" in args else args
project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
for requirement in project["dependencies"] + [r for extra in extras for r in project["optional-dependencies"][extra]]:
    if re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower() not in skip:
        print(requirement)
