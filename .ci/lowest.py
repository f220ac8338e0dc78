"""Print `name==floor.*` for each install requirement of setup.cfg with a lower bound, except
those whose floor the GPU runs test (Ray, torch, transformers): CI installs these over its
environment in a venv of their own and runs the unit tests there."""

import configparser
import re
from pathlib import Path

TESTED_ELSEWHERE = {"ray", "torch", "transformers"}
config = configparser.ConfigParser()
config.read(Path(__file__).resolve().parent.parent / "setup.cfg")
for line in config["options"]["install_requires"].splitlines():
    line = line.split("#", 1)[0].strip()
    match = re.match(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*>=\s*([0-9.]+)", line)
    if match and match.group(1).lower() not in TESTED_ELSEWHERE:
        print(f"{match.group(1)}=={match.group(3)}.*")
