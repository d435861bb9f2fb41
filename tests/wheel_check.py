"""The wheel as a user installs it: built from the tracked files, installed into a new virtual
environment that holds the dependencies but not the checkout, every module imported from it, and
the library used from it (a speculative ``RolloutEngine.generate`` with a drafter, and a two-step
``GRPOTrainer(rollout=SpecRollout(...))``); then, as a verl user installs it, ``tailspec[verl]`` into
a new environment that already holds torch 2.13.0: that torch is kept, transformers resolves inside
verl's range, ``import verl, tailspec`` works, the speculative ``generate`` runs there, and verl's
own ``LLMServerManager`` serves greedy requests through a tailspec replica (``rollout.name=tailspec``).

``make wheel-check`` (CI) runs this file; tests/test_wheel.py uses its pieces. The new environment
reaches this environment's packages through a ``.pth`` file, whose folder's own ``.pth`` files
Python does not run, so the checkout's editable install stays out of it. The library may not need
the development tools (pytest, hypothesis): a module whose import brings one in fails the check.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVELOPMENT_ONLY = ("pytest", "hypothesis", "_pytest", "xdist")


def checkout_only() -> tuple[str, ...]:
    """The folders setup.py keeps out of the wheel (read from it, so the two never disagree)."""
    scope: dict = {}
    exec(compile((ROOT / "setup.py").read_text(), "setup.py", "exec"), scope)  # its setup() runs only as __main__
    return scope["CHECKOUT_ONLY"]


def tracked_files() -> list[str]:
    listing = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [name for name in listing.splitlines() if (ROOT / name).is_file()]  # a file deleted in the tree is not built


def library_files() -> set[str]:
    """The names every tracked file of the library has in the wheel (``tailspec/rollout/engine.py``):
    the modules at the root but setup.py, and every file below a folder the checkout does not keep
    for itself (a folder that lost its ``__init__.py`` is then missed by the build and caught here)."""
    skipped = set(checkout_only())
    names = set()
    for name in tracked_files():
        top = name.split("/")[0]
        if name.endswith(".py") and "/" not in name and name != "setup.py":
            names.add(f"tailspec/{name}")
        elif "/" in name and not top.startswith(".") and top not in skipped:
            names.add(f"tailspec/{name}")
    return names


def build_wheel(out_dir: Path) -> Path:
    """The wheel built by setuptools from a copy of the tracked files (what a clean clone builds)."""
    source = Path(tempfile.mkdtemp(prefix="tailspec-src-", dir=out_dir))
    for name in tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    build = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(out_dir)], cwd=source, capture_output=True, text=True)
    shutil.rmtree(source)
    if done.returncode != 0:
        raise RuntimeError(f"building the wheel failed:\n{done.stderr[-3000:]}")
    (path,) = out_dir.glob("tailspec-*.whl")
    return path


def missing_from(wheel: zipfile.ZipFile) -> list[str]:
    """The library's tracked files that the wheel lacks."""
    return sorted(library_files() - set(wheel.namelist()))


def wheel_modules(wheel: zipfile.ZipFile) -> list[str]:
    """Every module the wheel holds, dotted (``tailspec.rollout.engine``)."""
    modules = []
    for name in wheel.namelist():
        if name.startswith("tailspec/") and name.endswith(".py"):
            parts = name.removesuffix(".py").split("/")
            modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(modules)


def fresh_environment(where: Path, wheel: Path) -> Path:
    """A new virtual environment with ``wheel`` installed and this environment's packages reachable;
    its Python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*install, "--ignore-installed", str(wheel)], check=True)
    return python


IMPORT_EVERY_MODULE = """
import importlib, json, sys, traceback

from tailspec.extras import MissingExtra

development_only, modules = json.loads(sys.argv[1])
failed, needs_extra = {}, {}
for module in modules:
    before = set(sys.modules)
    try:
        importlib.import_module(module)
    except MissingExtra as e:  # a part whose extra this environment does not install: its one line
        needs_extra[module] = str(e)
        continue
    except Exception:
        failed[module] = traceback.format_exc(limit=-3)
        continue
    tools = sorted(n for n in set(sys.modules) - before if n.split(".")[0] in development_only)
    if tools:
        failed[module] = f"imports development tools, not dependencies of the library: {tools}"
import tailspec
print(json.dumps({"failed": failed, "needs_extra": needs_extra, "location": tailspec.__file__}))
"""

GENERATE = """
import os, sys, tempfile
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
import torch
torch.set_num_threads(1)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import tailspec
from tailspec.testing import perturbed_copy, tiny_task_policy

# a character tokenizer: ids 0-3 special, then one id a character
special = ["<pad>", "<eos>", "<user>", "<assistant>"]
vocab = {t: i for i, t in enumerate(special + list("0123456789 +=abcdefghijklmnopqrstuvwxyz"))}
core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                    additional_special_tokens=special[2:], padding_side="left")
tokenizer.chat_template = ("{% for m in messages %}<user>{{ m['content'] }}{% endfor %}"
                           "{% if add_generation_prompt %}<assistant>{% endif %}")

policy = tiny_task_policy(tokenizer)
drafter = perturbed_copy(policy, noise=0.05)
prompts = [tokenizer(f"add {i} {i + 3}")["input_ids"] for i in range(4)]
params = tailspec.SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
plain = tailspec.RolloutEngine(policy, tailspec.RolloutConfig(strategy="none")).generate(prompts, params)
engine = tailspec.RolloutEngine(policy, tailspec.RolloutConfig(strategy="chain:3"), drafter=drafter)
spec = engine.generate(prompts, params)
assert [o.completion_ids for o in spec] == [o.completion_ids for o in plain], "speculative greedy differs from plain"
drafted = sum(o.num_drafted for o in spec)
assert drafted > 0, "chain:3 drafted nothing"
print(f"generate: chain:3 with a drafter LM equals plain greedy decoding ({drafted} tokens drafted)")
"""

USE_THE_LIBRARY = (
    GENERATE
    + """
from datasets import Dataset
from trl import GRPOConfig

rows = [{"prompt": [{"role": "user", "content": f"add {i % 10} {(3 * i) % 10}"}]} for i in range(8)]
with tempfile.TemporaryDirectory() as out:
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      max_steps=2, learning_rate=1e-3, report_to=[], use_cpu=True, bf16=False,
                      save_strategy="no", seed=0)
    rollout = tailspec.SpecRollout(strategy="chain:3", drafter=drafter)
    trainer = tailspec.GRPOTrainer(model=policy, reward_funcs=lambda completions, **kw: [float(len(c[0]["content"]))
                                   for c in completions], args=args, train_dataset=Dataset.from_list(rows),
                                   processing_class=tokenizer, rollout=rollout)
    trainer.train()
assert trainer.state.global_step == 2 and len(rollout.history) == 2, (trainer.state.global_step, rollout.history)
print("GRPOTrainer(rollout=SpecRollout(strategy='chain:3', drafter=...)): 2 steps")
"""
)


# beside verl: a user's environment that already holds torch, into which `pip install "tailspec[verl]"`
# must keep that torch and resolve transformers inside verl's own range
BESIDE_VERL = """
import importlib.metadata as md, json
from packaging.requirements import Requirement
import torch, transformers, verl, tailspec
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import RolloutReplicaRegistry
registered = RolloutReplicaRegistry.get("tailspec").__name__, get_rollout_class("tailspec", "async").__name__
wanted = [Requirement(r) for r in md.requires("verl") if r.startswith("transformers") and "extra ==" not in r]
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "verl": verl.__version__,
                  "transformers_in_verls_range": all(r.specifier.contains(transformers.__version__) for r in wanted),
                  "registered_with_verl": list(registered), "tailspec": tailspec.__file__}))
"""
# verl's own LLMServerManager launching a tailspec replica (rollout.name=tailspec) on Ray's CPUs
VERL_PATH = """
import asyncio, os, tempfile
import ray, torch, verl
import verl.trainer.config as trainer_config
from omegaconf import OmegaConf
from verl.workers.rollout.llm_server import LLMServerManager
from tailspec.testing import tiny_random_model
from tailspec.testing.families import no_cache_greedy
torch.set_num_threads(1)
policy = tiny_random_model("qwen2", seed=2)
folder = tempfile.mkdtemp()
policy.save_pretrained(folder)
cfg = OmegaConf.load(os.path.join(os.path.dirname(trainer_config.__file__), "_generated_ppo_trainer.yaml"))
cfg.actor_rollout_ref.model.path = folder
rollout = cfg.actor_rollout_ref.rollout
rollout.name, rollout.nnodes, rollout.n_gpus_per_node, rollout.tensor_model_parallel_size = "tailspec", 1, 1, 1
rollout.response_length = 12
rollout.engine_kwargs = {"tailspec": {"strategy": "suffix"}}
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
client = LLMServerManager.create(config=cfg).get_client()
prompts = [[5, 9, 17, 33, 3], [7, 7, 12, 7, 7, 12]]
async def run():
    greedy = {"temperature": 0.0}
    calls = [client.generate(f"q{i}", prompt_ids=p, sampling_params=greedy) for i, p in enumerate(prompts)]
    return await asyncio.gather(*calls)
outs = asyncio.run(run())
assert [o.token_ids for o in outs] == [no_cache_greedy(policy, p, 12) for p in prompts], "verl's greedy differs"
print(f"verl path: LLMServerManager with rollout.name=tailspec, {len(outs)} greedy requests equal a recompute")
"""
TORCH = "torch==2.13.0"


def beside_verl(work: Path, wheel: Path) -> str | None:
    """Install ``wheel[verl]`` into a new environment that holds :data:`TORCH` and check it there
    (the problem, or None)."""
    env = work / "verl-env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    python = env / "bin" / "python"
    # pip first: the venv's own pip (23.2 with Python 3.11) backtracked for over five minutes on verl's
    # requirements, where a current one resolves them in seconds
    for what in (["-U", "pip"], [TORCH], [f"{wheel}[verl]"]):
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *what], capture_output=True, text=True)
        if done.returncode != 0:
            return f"pip install {' '.join(what)} failed:\n{done.stderr[-3000:]}"
    elsewhere = work / "elsewhere"
    checked = run_in(python, BESIDE_VERL, cwd=elsewhere)
    if checked.returncode != 0:
        return f"import verl, tailspec failed:\n{checked.stderr[-3000:]}"
    found = json.loads(checked.stdout.strip().splitlines()[-1])
    print(f"wheel-check beside verl: {json.dumps(found)}")
    if found["torch"].split("+")[0] != TORCH.split("==")[1]:
        return f"installing tailspec[verl] replaced the environment's torch {TORCH} by {found['torch']}"
    if not found["transformers_in_verls_range"]:
        return f"transformers {found['transformers']} is outside verl's range"
    for name, code in (("generate", GENERATE), ("the verl path", VERL_PATH)):
        used = run_in(python, code, cwd=elsewhere)
        print(used.stdout, end="")
        if used.returncode != 0:
            return f"{name} beside verl failed:\n{used.stderr[-3000:]}"
    return None


def run_in(python: Path, code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``code`` run by ``python`` in ``cwd``, with no PYTHONPATH (nothing of the checkout reachable)."""
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(python), "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="build and install under this folder and keep it")
    args = parser.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="tailspec-wheel-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        wheel_path = build_wheel(work)
        wheel = zipfile.ZipFile(wheel_path)
        missing = missing_from(wheel)
        if missing:
            print(f"wheel-check: the wheel lacks {len(missing)} of the library's files:", *missing, sep="\n  ")
            return 1
        modules = wheel_modules(wheel)
        print(f"wheel-check: built {wheel_path.name}: {len(modules)} modules, every tracked library file")
        python = fresh_environment(work / "env", wheel_path)
        elsewhere = work / "elsewhere"
        elsewhere.mkdir(exist_ok=True)
        imported = run_in(python, IMPORT_EVERY_MODULE, json.dumps([DEVELOPMENT_ONLY, modules]), cwd=elsewhere)
        if imported.returncode != 0:
            print(f"wheel-check: importing from the wheel failed:\n{imported.stderr[-3000:]}")
            return 1
        report = json.loads(imported.stdout.strip().splitlines()[-1])
        if not report["location"].startswith(str(work / "env")):
            print(f"wheel-check: tailspec was imported from {report['location']}, not from the installed wheel")
            return 1
        if report["failed"]:
            print(f"wheel-check: {len(report['failed'])} modules do not import from the wheel:")
            for module, error in report["failed"].items():
                print(f"  {module}:\n    " + error.strip().replace("\n", "\n    "))
            return 1
        extra = "".join(f"\n  {m}: {why}" for m, why in report["needs_extra"].items())
        print(f"wheel-check: every module imports from {report['location']}; what needs an extra says so:{extra}")
        used = run_in(python, USE_THE_LIBRARY, cwd=elsewhere)
        print(used.stdout, end="")
        if used.returncode != 0:
            print(f"wheel-check: using the library from the wheel failed:\n{used.stderr[-4000:]}")
            return 1
        problem = beside_verl(work, wheel_path)
        if problem is not None:
            print(f"wheel-check beside verl: {problem}")
            return 1
        print("wheel-check: passed")
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
