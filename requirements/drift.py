"""Print how the running environment differs from the lock: `python requirements/drift.py LOCK`.

Used by `make test-latest`, so that a failure there can be traced to the peer whose version moved.
"""

import re
import sys
from importlib import metadata


def pins(lock_path: str) -> dict[str, str]:
    pattern = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s;]+)")
    found = {}
    with open(lock_path, encoding="utf-8") as f:
        for line in f:
            m = pattern.match(line)
            if m:
                found[m.group(1).lower().replace("_", "-")] = m.group(2)
    return found


def main() -> int:
    locked = pins(sys.argv[1])
    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions()}
    moved = [(n, v, installed.get(n, "absent")) for n, v in sorted(locked.items()) if installed.get(n) != v]
    added = sorted(set(installed) - set(locked) - {"linattn", "pip", "setuptools", "wheel"})
    for name, old, new in moved:
        print(f"{name}: lock {old} -> here {new}")
    for name in added:
        print(f"{name}: not in the lock, here {installed[name]}")
    if not moved and not added:
        print("this environment equals the lock")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
