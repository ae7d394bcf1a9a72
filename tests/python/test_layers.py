"""The C++ folders depend only downward (docs/engine.md, "Layers"): a file includes headers
of its own folder and of the layers below it, never of a layer above. A new folder must be
placed in the table before its files may be included anywhere."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Bottom to top: each folder and the folders it may include besides itself.
LAYERS = {
    "core": set(),
    "collectives": {"core"},
    "sharding_rules": {"core", "collectives"},  # rules price moves with the (pure) redistribution planner
    "dispatch": {"core", "collectives", "sharding_rules"},
    "autoplan": {"core", "collectives", "sharding_rules", "dispatch"},
    "bindings": {"core", "collectives", "sharding_rules", "dispatch", "autoplan"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"/]+)/', re.M)


def _includes(folder: str) -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / folder).glob("*")):
        if path.suffix in (".h", ".cpp"):
            out += [(path.relative_to(ROOT).as_posix(), dep) for dep in INCLUDE.findall(path.read_text())]
    return out


def test_every_cpp_folder_has_a_layer():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    used = set(re.findall(r"(?:^|\s|/)([a-z_]+)/[a-z_]+\.cpp", cmake, re.M)) - {"tests", "cpp"}
    assert used <= set(LAYERS), f"folders compiled but not layered: {sorted(used - set(LAYERS))}"


def test_includes_point_only_downward():
    wrong = [f"{path} includes {dep}/" for folder, allowed in LAYERS.items()
             for path, dep in _includes(folder) if dep != folder and dep not in allowed]
    assert not wrong, "includes against the layering:\n" + "\n".join(wrong)


def test_the_table_is_checked_on_files():
    # The scan must see the real sources (a wrong ROOT would make every check vacuous).
    assert any(dep == "core" for path, dep in _includes("dispatch"))
    assert len(_includes("core")) >= 3
