"""The engine path needs none of the trainer stack: a lent GPU's image has no trl, ray, deepspeed or
wandb (docs/GPU.md), and ``make gpu-check`` runs the engine there as it is."""

import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import tailspec

BLOCKED = ("trl", "ray", "deepspeed", "wandb")


def site_without_trainer_stack(root: Path) -> Path:
    """A copy (by links) of this environment's site-packages with the four packages left out, and
    tailspec on it from this checkout: what the GPU image looks like to an import."""
    site = root / "site"
    site.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower().replace("-", "_")
        if not any(name == b or name.startswith(b + "_") or name.startswith(b + ".") for b in BLOCKED):
            (site / entry.name).symlink_to(entry)
    (site / "tailspec").symlink_to(Path(tailspec.__file__).parent)
    return site


def test_the_engine_imports_and_decodes_with_the_trainer_stack_unavailable(tmp_path, child_env):
    site = site_without_trainer_stack(tmp_path)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(site)!r}]
        import importlib.util
        assert all(importlib.util.find_spec(m) is None for m in {BLOCKED!r})
        from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
        from tailspec.testing import perturbed_copy, random_prompts, tiny_random_model
        import tailspec.benchmarks.gpu.speed, tailspec.tasks.grow, tailspec.tasks.sft

        model = tiny_random_model("llama", seed=1)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        prompts = random_prompts(3, seed=2)
        want = RolloutEngine(model).generate(prompts, greedy)
        engine = RolloutEngine(model, RolloutConfig(strategy="chain:3"), drafter=perturbed_copy(model, 0.3, seed=7))
        got = engine.generate(prompts, greedy)
        assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
        print(sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r}))
        """
    )
    # -S: no site-packages but the filtered copy (and no editable-install hooks)
    out = subprocess.run(
        [sys.executable, "-S", "-c", script], capture_output=True, text=True, env=child_env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
