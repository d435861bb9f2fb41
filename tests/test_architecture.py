"""The package's layering (docs/ARCHITECTURE.md, "The map") as a test: every module imports only
modules of its own unit or of a lower floor, lazy imports inside functions included, so no arrow
runs back up and no circle can form between units."""

import ast
from pathlib import Path

from package_imports import imported_modules, imported_units

ROOT = Path(__file__).resolve().parent.parent

# lowest first; a unit may import its own modules and any unit of a lower floor
FLOORS: list[set[str]] = [
    {"safe_files", "extras"},
    {"draft_contract", "config_tree", "kernels", "progress", "distributed", "packed_weights", "actors"},
    {"rollout"},
    {"drafter", "atts", "testing"},
    {"workers", "tasks"},
    {"trainer_hooks"},
    {"demo"},
    {"benchmarks"},
    {"cli"},
]
OUTSIDE = {"tests", "examples", "outputs", "assets", "configs", "docs", "tailspec.egg-info"}


def _floor(unit: str) -> int:
    return next(i for i, units in enumerate(FLOORS) if unit in units)


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in OUTSIDE or rel.parts[0].startswith(".") or "__pycache__" in rel.parts:
            continue
        if rel == Path("__init__.py"):
            continue  # the public API: lazy names of every floor
        if rel == Path("setup.py"):
            continue  # the build script, left out of the package
        yield rel


def _imported_units(rel: Path) -> set[str]:
    return imported_units((ROOT / rel).read_text(), ["tailspec", *rel.parent.parts])


def test_every_unit_sits_on_a_floor():
    units = {rel.parts[0].removesuffix(".py") for rel in _modules()}
    placed = set().union(*FLOORS)
    assert units <= placed, f"place these in FLOORS (and in docs/ARCHITECTURE.md's map): {sorted(units - placed)}"


def test_no_import_runs_back_up():
    wrong = []
    for rel in _modules():
        unit = rel.parts[0].removesuffix(".py")
        for target in _imported_units(rel) - {unit}:
            if target in set().union(*FLOORS) and _floor(target) >= _floor(unit):
                wrong.append(f"{rel} imports {target} (floor {_floor(target)} >= {unit}'s {_floor(unit)})")
    assert not wrong, "\n".join(wrong)


def test_the_rollout_engine_reaches_drafters_only_by_name():
    """rollout/ never imports drafter/: the contract names the factory, imported when first needed."""
    assert not any("drafter" in _imported_units(rel) for rel in _modules() if rel.parts[0] == "rollout")


# rollout/'s rooms: model/ at the ground (it imports no other rollout module), the step loop's
# modules at the top, and between them spec/, mirror/ (over spec/) and adaptive/
STEP_LOOP = {"engine", "serving", "launcher", "host_step", "proposer", "request_book", "feature_taps", "prefill"}
NOT_FROM = {
    "spec": {"mirror", "adaptive", *STEP_LOOP},
    "mirror": {"adaptive", *STEP_LOOP},
    "adaptive": {"spec", "mirror", *STEP_LOOP},
}


def _rollout_imports(rel: Path) -> set[str]:
    """The rollout modules or subpackages (first name under rollout/) that ``rel`` imports."""
    found = imported_modules((ROOT / rel).read_text(), ["tailspec", *rel.parent.parts])
    return {t[1] for t in found if t[0] == "rollout" and len(t) > 1}


def test_rollout_rooms_import_downwards():
    wrong = []
    for rel in _modules():
        if rel.parts[0] == "rollout" and len(rel.parts) == 3:
            room, imported = rel.parts[1], _rollout_imports(rel) - {rel.parts[1]}
            for name in imported if room == "model" else imported & NOT_FROM[room]:
                wrong.append(f"{rel} imports rollout.{name}")
    assert not wrong, "\n".join(wrong)


def test_rollout_config_imports_no_implementation():
    """params.py and strategy.py (what users configure) import only each other and token ids."""
    for name in ("params", "strategy"):
        assert _rollout_imports(Path("rollout") / f"{name}.py") <= {"params", "strategy", "token_ids"}, name


def test_the_rollout_modules_stay_small():
    """A step you read in a few lines: the engine at most 300 lines, no other rollout module over 400
    (a module outgrowing that is split by job, as the forward table was from the cost model), no
    function in rollout/ over 60 lines."""
    sizes = {rel: len((ROOT / rel).read_text().splitlines()) for rel in _modules() if rel.parts[0] == "rollout"}
    assert sizes[Path("rollout/engine.py")] <= 300
    assert not {str(rel): n for rel, n in sizes.items() if n > 400}
    long = {}
    for rel in sizes:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long[f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long


def test_the_loop_holds_the_step_in_flight_alone():
    """One loop and one commit: no second step path, no overlap switch, no in-flight counter on a
    sequence, nothing settled outside the step in flight."""
    gone = {
        "rollout/params.py": ["overlap:"],
        "rollout/request.py": ["tokens_in_flight"],
        "rollout/engine.py": ["_settled_early", "_overlaps", "_read_in_flight"],
    }
    for rel, names in gone.items():
        text = (ROOT / rel).read_text()
        assert not [name for name in names if name in text], rel
    assert not (ROOT / "rollout" / "decode_step.py").exists()


def test_mirror_is_a_drafter_the_engine_does_not_name():
    """Mirror-SD is a drafter (rollout/mirror/drafter.py) the factory builds: the engine, the proposer
    and the launcher neither build nor name its pipeline, slot or executor switches."""
    for rel in ("rollout/engine.py", "rollout/proposer.py", "rollout/launcher.py"):
        text = (ROOT / rel).read_text()
        named = ("MirrorSlot", "MirrorPipeline", "MirrorDrafter", "use_draft_executor", "mirror_capable")
        assert not [n for n in named if n in text], rel
    assert not (ROOT / "rollout" / "mirror" / "slot.py").exists()


def test_a_drafter_implements_at_most_eight_methods_and_drafts_one_way():
    """The contract's methods (draft the one abstract) and no second way to draft on it."""
    from tailspec.draft_contract import Drafter

    methods = {n for n, v in vars(Drafter).items() if callable(v) and not n.startswith("_")}
    assert len(methods) <= 8 and Drafter.__abstractmethods__ == frozenset({"draft"})
    assert not methods & {"propose", "draft_on_device", "draft_tree_on_device", "accepted", "settled_on_device"}
