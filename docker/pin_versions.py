"""Write docker/constraints.txt: every distribution the images install (the gateway's smg too) besides
torch (and what only torch pulls in), pinned to the version installed here, where the tests ran with it.

    python docker/pin_versions.py      # after upgrading the environment; commit the file it writes

Both Dockerfiles install with `-c docker/constraints.txt`, so an image holds the versions the tests
passed with; pyproject.toml keeps its loose lower bounds for people installing the project.
tests/deploy/test_docker_images.py resolves the control plane's requirements against the registry
under these constraints and fails if any distribution is left unpinned.
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docker" / "constraints.txt"
HEAVY = {"torch", "triton"}  # the data plane pins torch by TORCH_VERSION, and torch pins its triton


def closure(requirements: list[Requirement]) -> dict[str, str]:
    """Installed name -> version of everything these requirements pull in (extras and markers honoured)."""
    seen: dict[str, str] = {}
    todo = [(r, frozenset(r.extras)) for r in requirements]
    done: set[tuple[str, frozenset]] = set()
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in HEAVY or (name, extras) in done or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        done.add((name, extras))
        try:
            seen[name] = metadata.version(req.name)
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((Requirement(str(sub).split(";")[0]), frozenset(sub.extras)))
    return seen


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The gateway's image (docker/smg.Dockerfile) installs the smg that the dev extra pins.
    gateway = [Requirement(d) for d in project["optional-dependencies"]["dev"] if Requirement(d).name == "smg"]
    pins = closure([Requirement(d) for d in project["dependencies"]] + gateway)
    lines = [f"{name}=={version}" for name, version in sorted(pins.items())]
    OUT.write_text("# Written by docker/pin_versions.py: the images' versions, the ones the tests ran with.\n"
                   + "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} pins to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
