"""docs/deploy.md's offline image recipe (its sh block that starts with `pip wheel`), as the commands .ci/build-images
runs: the same lines, with this machine's pip, its base image and CI's tags in place of `<registry>/…:0.1.0`.
Prints one command a line. Usage: python3 .ci/deploy-recipe.py PIP BASE"""

import re
import shlex
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"


def recipe(text: str) -> list[str]:
    for block in re.findall(r"^ *```sh\n(.*?)^ *```", text, re.S | re.M):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if lines and lines[0].startswith("pip wheel "):
            return lines
    raise SystemExit(f"{DOC}: no sh block starting with `pip wheel`")


def commands(pip: str, base: str, text: str) -> list[str]:
    out = []
    for line in recipe(text):
        line = re.sub(r"<registry>/(gpuhook-[a-z-]+):0\.1\.0", r"localhost/\1:ci", line)
        if line.startswith("pip "):
            line = shlex.quote(pip) + line[3:]
        elif line.startswith("podman build "):
            line = f"podman build --quiet --build-arg BASE={shlex.quote(base)} " + line[len("podman build "):]
        else:
            raise SystemExit(f"{DOC}: unexpected line in the offline recipe: {line}")
        out.append(line)
    return out


if __name__ == "__main__":
    print("\n".join(commands(sys.argv[1], sys.argv[2], DOC.read_text())))
